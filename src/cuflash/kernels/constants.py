"""Constants that the kernels and their launch arguments (variant.py) share."""
import triton.language as tl

# exp(x) == exp2(x * LOG2E): the kernels fold LOG2E into the softmax scale and use exp2.
LOG2E = tl.constexpr(1.4426950408889634)
# log(x) == log2(x) * LN2: the log-sum-exp from the base-2 running max and sum.
LN2 = tl.constexpr(0.6931471805599453)

# attn_mask kinds (constexpr MASK_KIND)
NO_MASK = tl.constexpr(0)
BOOL_MASK = tl.constexpr(1)
ADDITIVE_MASK = tl.constexpr(2)
