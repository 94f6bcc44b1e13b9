"""OCP Microscaling (MX) v1.0 formats: MXFP4 weights, MXFP8 activations (k3_techniques.md §7).

A block of 32 elements along `axis` shares one E8M0 scale X = 2^(e - 127) (bias 127, 0xFF = NaN,
no sign, no zero); the elements are E2M1 ("mxfp4": +-{0, .5, 1, 1.5, 2, 3, 4, 6}) or E4M3
("mxfp8": max 448, smallest subnormal 2^-9).

Scale rules (`quantize(..., scale_rule=)`):
  "floor" (the spec's): shared_exp = floor(log2 max_i |V_i|) - emax_elem (2 for E2M1, 8 for E4M3);
      the block maximum can clip (7.9 -> 6 with X = 1).
  "ceil": X = 2^ceil(log2(max_i |V_i| / max_elem)), the smallest power of two that never clips.
Elements P_i = V_i / X rounded to nearest, ties to even, saturating to +-max_elem (E4M3 never
produces its NaN code).

Special blocks:
  - all-zero block: shared_exp clamps to -127 (scale byte 0x00) and every element is a zero of the
    input's sign, so `dequantize` gives exact zeros.
  - NaN or +-Inf anywhere in a block: the scale is NaN (0xFF) and every element is +0;
    `dequantize` gives NaN for the whole block (the spec's NaN scale; E2M1 has no NaN or Inf).
  - subnormal inputs (|V| < 2^-126, including a whole block of them): read from their bits, never
    flushed, so the result does not depend on the platform's denormal mode. Elements that fall
    below the element type's smallest normal round on its subnormal grid (E2M1 0.5, E4M3
    m * 2^-9). `dequantize` itself returns float32, whose subnormal results (|value| < 2^-126,
    reachable only with scale bytes below 0x0A) are flushed to zero on platforms that flush.
  - shared_exp is clamped to E8M0's range [-127, 127]; float32 inputs reach only the lower end
    (blocks with max |V| < 2^(-127 + emax_elem)).
The axis length must be a multiple of 32.

All rounding is integer arithmetic on float32 bits (no float -> float4/float8 conversion does
any rounding), so it is the same under jit on CPU, GPU and TPU.

K3 checkpoint layout (k3_hf_names.md): `pack_k3` / `unpack_k3` convert [..., out, in] weights to
and from `weight_packed` uint8 [..., out, in/2] (element 2j in the low nibble, 2j+1 in the high
nibble, the nibble being the E2M1 bit code) and `weight_scale` uint8 [..., out, in/32] (E8M0
bits); blocks run along `in`. `pack_experts` converts a float model's routed experts into the
packed variables of `model.moe.expert_format="mxfp4"`.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK = 32
SCALE_RULES = ("floor", "ceil")
# The E2M1 bit code c (sign bit 3) -> value: the nibble table of the K3 checkpoint.
E2M1_VALUES = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6],
                       np.float32)


@dataclasses.dataclass(frozen=True)
class ElementFormat:
  """An MX element type: `mantissa_bits`, smallest normal exponent `emin`, largest exponent
  `emax` and largest finite value `max_value`."""
  dtype: jnp.dtype
  mantissa_bits: int
  emin: int
  emax: int
  max_value: float


FORMATS = {
    "mxfp4": ElementFormat(jnp.float4_e2m1fn, 1, 0, 2, 6.0),
    "mxfp8": ElementFormat(jnp.float8_e4m3fn, 3, -6, 8, 448.0),
}


def _check(x: jax.Array, fmt: str, axis: int) -> int:
  """The non-negative axis of x [..., n, ...] along which blocks of 32 run."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {tuple(FORMATS)}, got {fmt!r}")
  if not -x.ndim <= axis < x.ndim:
    raise ValueError(f"axis {axis} out of range for an array of shape {x.shape}")
  axis %= x.ndim
  if x.shape[axis] % BLOCK:
    raise ValueError(f"the length {x.shape[axis]} of axis {axis} (shape {x.shape}) is not a "
                     f"multiple of the MX block size {BLOCK}")
  return axis


def _pow2(e: jax.Array) -> jax.Array:
  """2^e in float32 for int32 e in [-126, 127], built from its exponent bits."""
  return jax.lax.bitcast_convert_type((e + 127).astype(jnp.uint32) << 23, jnp.float32)


def _quantize_blocks(x: jax.Array, spec: ElementFormat,
                     scale_rule: str) -> tuple[jax.Array, jax.Array, jax.Array]:
  """x [..., nb, 32] -> (signed element values [..., nb, 32] float32 on the element grid,
  shared exponents [..., nb] int32 in [-127, 127], non-finite block mask [..., nb])."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  negative = (bits >> 31) == 1
  mag = bits & jnp.uint32(0x7FFFFFFF)
  # Non-negative float32 bit patterns order as integers: NaN > Inf > finite.
  amax = jnp.max(mag, axis=-1)
  nonfinite = amax >= jnp.uint32(0x7F800000)
  amax_exp = (amax >> 23).astype(jnp.int32) - 127          # -127 for subnormal amax or zero
  if scale_rule == "floor":
    shared = amax_exp - spec.emax
  else:
    max_bits = int(np.array(spec.max_value, np.float32).view(np.uint32))
    above = (amax & 0x7FFFFF) > (max_bits & 0x7FFFFF)
    shared = amax_exp - spec.emax + above.astype(jnp.int32)
  shared = jnp.where(amax_exp == -127, -127, jnp.clip(shared, -127, 127))

  # |x| = full * 2^(max(ex, 1) - 150) with full < 2^24 (implicit bit only for normals).
  ex = (mag >> 23).astype(jnp.int32)
  full = (mag & 0x7FFFFF) | jnp.where(ex > 0, jnp.uint32(0x800000), jnp.uint32(0))
  ex = jnp.maximum(ex, 1)
  s = shared[..., None]
  log2_full = 31 - jax.lax.clz(full.astype(jnp.int32))     # -1 for full == 0
  exp_v = log2_full + ex - 150 - s                          # floor(log2 |x / X|)
  quantum_exp = jnp.maximum(exp_v, spec.emin) - spec.mantissa_bits
  drop = jnp.clip(quantum_exp + 150 + s - ex, 0, 25).astype(jnp.uint32)
  half = jnp.where(drop > 0, jnp.uint32(1) << jnp.maximum(drop, 1) - 1, jnp.uint32(0))
  odd = (full >> drop) & 1
  rounded = jnp.where(drop > 0, (full + half - 1 + odd) >> drop, full)
  value = rounded.astype(jnp.float32) * _pow2(jnp.clip(quantum_exp, -126, 127))
  value = jnp.minimum(value, spec.max_value)
  value = jnp.where(nonfinite[..., None], 0.0, jnp.where(negative, -value, value))
  return value, shared, nonfinite


def _blocked(x: jax.Array, axis: int) -> jax.Array:
  """x with `axis` moved last and split into blocks: [..., n/32, 32]."""
  x = jnp.moveaxis(x, axis, -1)
  return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _scale_bits(shared: jax.Array, nonfinite: jax.Array) -> jax.Array:
  return jnp.where(nonfinite, 255, shared + 127).astype(jnp.uint8)


def quantize(x: jax.Array, fmt: str, axis: int = -1,
             scale_rule: str = "floor") -> tuple[jax.Array, jax.Array]:
  """MX quantization of x along `axis` (OCP MX v1.0 §6.3; module docstring for special blocks).

  x [..., n, ...] (n along `axis`, a multiple of 32) -> (elements [..., n, ...] as
  `jnp.float4_e2m1fn` ("mxfp4") or `jnp.float8_e4m3fn` ("mxfp8"), scales [..., n/32, ...] as
  `jnp.float8_e8m0fnu`).
  """
  axis = _check(x, fmt, axis)
  if scale_rule not in SCALE_RULES:
    raise ValueError(f"scale_rule must be one of {SCALE_RULES}, got {scale_rule!r}")
  spec = FORMATS[fmt]
  value, shared, nonfinite = _quantize_blocks(_blocked(x, axis), spec, scale_rule)
  elements = jnp.moveaxis(value.reshape(*value.shape[:-2], -1).astype(spec.dtype), -1, axis)
  scales = jax.lax.bitcast_convert_type(_scale_bits(shared, nonfinite), jnp.float8_e8m0fnu)
  return elements, jnp.moveaxis(scales, -1, axis)


def _apply_scale(values: jax.Array, scale_bits: jax.Array) -> jax.Array:
  """values [..., nb, 32] float32 times 2^(scale_bits - 127) [..., nb] (0xFF: NaN); the power
  is applied as two normal factors, so scale bytes below 2^-126 are not flushed on the way."""
  e = scale_bits.astype(jnp.int32) - 127
  e1 = e >> 1
  out = values * _pow2(e1)[..., None] * _pow2(e - e1)[..., None]
  return jnp.where((scale_bits == 255)[..., None], jnp.nan, out)


def dequantize(elements: jax.Array, scales: jax.Array, axis: int = -1) -> jax.Array:
  """elements [..., n, ...] (any float dtype, n along `axis`), scales [..., n/32, ...]
  (`jnp.float8_e8m0fnu` or its uint8 bits) -> float32 [..., n, ...] = element * scale."""
  axis %= elements.ndim
  if elements.shape[axis] % BLOCK:
    raise ValueError(f"the length {elements.shape[axis]} of axis {axis} (shape "
                     f"{elements.shape}) is not a multiple of the MX block size {BLOCK}")
  expected = elements.shape[:axis] + (elements.shape[axis] // BLOCK,) + elements.shape[axis + 1:]
  if scales.shape != expected:
    raise ValueError(f"scales must have shape {expected} for elements {elements.shape} along "
                     f"axis {axis}, got {scales.shape}")
  if scales.dtype != jnp.uint8:
    scales = jax.lax.bitcast_convert_type(scales, jnp.uint8)
  out = _apply_scale(_blocked(elements.astype(jnp.float32), axis),
                     jnp.moveaxis(scales, axis, -1))
  return jnp.moveaxis(out.reshape(*out.shape[:-2], -1), -1, axis)


def fake_quantize(x: jax.Array, fmt: str, axis: int = -1,
                  scale_rule: str = "floor") -> jax.Array:
  """QAT fake quantization with a straight-through estimator (k3_techniques.md §7):
  x + stop_gradient(DQ(Q(x)) - x), in x's dtype. Forward: the dequantized MX value (exact in
  bf16 and fp32); backward: the identity. The sum is formed in fp32, where it is exact."""
  xf = x.astype(jnp.float32)
  dq = dequantize(*quantize(x, fmt, axis, scale_rule), axis=axis)
  return (xf + jax.lax.stop_gradient(dq - xf)).astype(x.dtype)


def pack_k3(w: jax.Array, scale_rule: str = "floor") -> tuple[jax.Array, jax.Array]:
  """w [..., out, in] -> (weight_packed uint8 [..., out, in/2], weight_scale uint8
  [..., out, in/32]): MXFP4 along `in`, the K3 checkpoint layout (k3_hf_names.md)."""
  if w.ndim < 2 or w.shape[-1] % BLOCK:
    raise ValueError(f"w must be [..., out, in] with in a multiple of {BLOCK}, got {w.shape}")
  value, shared, nonfinite = _quantize_blocks(_blocked(w, -1), FORMATS["mxfp4"], scale_rule)
  value = value.reshape(w.shape)
  magnitude = jnp.abs(value)
  code = jnp.sum(magnitude[..., None] >= jnp.asarray(E2M1_VALUES[1:8]), axis=-1)
  negative = jax.lax.bitcast_convert_type(value, jnp.uint32) >> 31
  code = (code.astype(jnp.uint32) | negative << 3).astype(jnp.uint8)
  packed = code[..., 0::2] | (code[..., 1::2] << 4)
  return packed, _scale_bits(shared, nonfinite)


def unpack_k3(weight_packed: jax.Array, weight_scale: jax.Array,
              dtype=jnp.float32) -> jax.Array:
  """(weight_packed uint8 [..., out, in/2], weight_scale uint8 [..., out, in/32]) -> [..., out,
  in] in `dtype` = E2M1 value of each nibble (low nibble: even column) * 2^(scale - 127),
  computed in float32 and rounded to `dtype`. A 16-bit dtype is built a byte at a time (its two
  values' bits as one uint32, bitcast), so XLA writes it without interleaving the nibbles."""
  if weight_packed.dtype != jnp.uint8 or weight_scale.dtype != jnp.uint8:
    raise ValueError(f"weight_packed and weight_scale must be uint8, got "
                     f"{weight_packed.dtype} and {weight_scale.dtype}")
  half_in = weight_packed.shape[-1]
  if (weight_packed.ndim < 2 or 2 * half_in % BLOCK
      or weight_scale.shape != weight_packed.shape[:-1] + (2 * half_in // BLOCK,)):
    raise ValueError(f"weight_packed must be [..., out, in/2] and weight_scale [..., out, "
                     f"in/32] with in a multiple of {BLOCK}, got {weight_packed.shape} and "
                     f"{weight_scale.shape}")
  table = jnp.asarray(E2M1_VALUES)
  if jnp.dtype(dtype).itemsize == 2:
    def half(codes):
      values = table[codes.astype(jnp.int32)].reshape(*weight_scale.shape, BLOCK // 2)
      bits = jax.lax.bitcast_convert_type(_apply_scale(values, weight_scale).astype(dtype),
                                          jnp.uint16)
      return bits.astype(jnp.uint32).reshape(weight_packed.shape)
    pairs = half(weight_packed & 0xF) | (half(weight_packed >> 4) << 16)
    return jax.lax.bitcast_convert_type(pairs, dtype).reshape(*weight_packed.shape[:-1],
                                                              2 * half_in)
  codes = jnp.stack([weight_packed & 0xF, weight_packed >> 4], axis=-1)
  values = table[codes.astype(jnp.int32)].reshape(*weight_scale.shape, BLOCK)
  return _apply_scale(values, weight_scale).reshape(*weight_packed.shape[:-1],
                                                    2 * half_in).astype(dtype)


def pack_experts(params: dict, buffers: dict, scale_rule: str = "floor") -> tuple[dict, dict]:
  """A float model's state -> the state of the same model with
  `model.moe.expert_format="mxfp4"` (routed experts packed in the K3 checkpoint layout).

  params, buffers: pure dicts (`nnx.to_pure_dict`) of the float model. Every `experts` dict of
  params with w1/w3 [E, l, m] and w2 [E, m, l] (k3jax layout [E, in, out]) leaves params and
  reappears in buffers at the same path as `{w}_packed` uint8 [E, out, in/2] and `{w}_scale`
  uint8 [E, out, in/32]: `pack_k3` of the HF layout [E, out, in], whose unpacked values are the
  QAT layer's fake-quantized weights (`fake_quantize(w, "mxfp4", axis=-2)`) transposed.
  """
  from k3jax.latent_moe import EXPERT_WEIGHTS  # imported here: latent_moe imports this module

  def walk(node: dict) -> tuple[dict, dict]:
    kept, packed = {}, {}
    for key, value in node.items():
      if not isinstance(value, dict):
        kept[key] = value
        continue
      if key == "experts" and all(w in value for w in EXPERT_WEIGHTS):
        rest = {k: v for k, v in value.items() if k not in EXPERT_WEIGHTS}
        sub = {}
        for w in EXPERT_WEIGHTS:
          sub[f"{w}_packed"], sub[f"{w}_scale"] = pack_k3(jnp.swapaxes(value[w], -1, -2),
                                                          scale_rule)
      else:
        rest, sub = walk(value)
      if rest:
        kept[key] = rest
      if sub:
        packed[key] = sub
    return kept, packed

  def merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, value in b.items():
      out[key] = merge(out[key], value) if key in out else value
    return out

  kept, packed = walk(params)
  return kept, merge(buffers, packed)
