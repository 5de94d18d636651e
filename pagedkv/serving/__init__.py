"""Serving: continuous batching (``Engine``), its owner thread (``EngineThread``) and
``pagedkv serve``, an OpenAI-compatible HTTP server (``app``, ``server``).

``Engine``, ``SamplingParams`` and ``TextStream`` need only the core package and
``prometheus_client``; the HTTP server needs the ``serve`` extra
(``pip install 'pagedkv[serve]'``: starlette, uvicorn, prometheus-client).
"""

from pagedkv.serving.engine import (
    Delta,
    Engine,
    EngineLimits,
    GenerationRequest,
    RequestTooLarge,
    Usage,
)
from pagedkv.serving.sampling import SamplingParams, sample_rows
from pagedkv.serving.text_stream import TextStream

__all__ = ["Delta", "Engine", "EngineLimits", "GenerationRequest", "RequestTooLarge", "SamplingParams",
           "TextStream", "Usage", "sample_rows"]
