Token writes into a layer's K and V pool arrays in place (see page_write.py).

One thread per element written: elements [0, n * WK) are K's, the rest V's. Element e of
token n goes to pool row rows[n], slot slots[n], column e. The pool arrays are inputs,
written through their pointers: MLX allocates no output for them, so it never copies a
layer to write a token. The one-element output ``done`` is what later reads depend on.

// @section body
  const size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t n = size_t(count[0]);
  if (i == 0) {
    done[0] = 0;
  }
  if (i < n * WK) {
    const size_t t = i / WK, c = i % WK;
    const size_t dst = (size_t(rows[t]) * PS + size_t(slots[t])) * WK + c;
    const_cast<TK*>(kpool)[dst] = kvals[i];
  } else if (i < n * (WK + WV)) {
    const size_t j = i - n * WK;
    const size_t t = j / WV, c = j % WV;
    const size_t dst = (size_t(rows[t]) * PS + size_t(slots[t])) * WV + c;
    const_cast<TV*>(vpool)[dst] = vvals[j];
  }
