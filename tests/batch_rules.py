"""Rules the state machines share: any subset of a ``PagedBatch``'s rows stays."""

import hypothesis.strategies as st
from hypothesis.stateful import precondition, rule


class FilterBatchRule:
    """Mixed into a ``RuleBasedStateMachine`` with ``batch`` (a ``PagedBatch``) and
    ``rows`` (the reference of each row, in order)."""

    @precondition(lambda self: self.rows)
    @rule(data=st.data())
    def filter_batch(self, data):
        keep = data.draw(st.lists(st.integers(0, len(self.rows) - 1), unique=True))
        self.batch.filter(keep)
        self.rows = [self.rows[i] for i in keep]
