import os
import sys
from pathlib import Path

# MLX's CUDA backend multiplies float32 matrices in TF32 by default (10-bit mantissas),
# and cuBLAS picks its kernel by shape, so a batch of 8 and one request alone round
# differently. The exactness tests compare float32 greedy tokens with mlx-lm's, where a
# TF32 rounding can flip a near-tie between random-weight logits (seen on an H100 in the
# gemma3 engine test). Full float32 here; set before mlx reads it. No effect on CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

sys.path.insert(0, str(Path(__file__).parent))
