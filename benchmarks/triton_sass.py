"""What the MXFP4 triton tier's program compiles to, read on any host (no GPU): registers, shared
memory and SASS instructions in all and in its K loop's body, by opcode.

The call is lowered for an H200 (an abstract mesh of one), the Triton module is read from the
lowered program's `__gpu$xla.gpu.triton` custom call (the MLIR bytecode Pallas writes into its
backend config) and compiled by the `triton` package's own compiler for sm_90a: PTX, then
ptxas and cuobjdump (both ship with the package). The GPU build is XLA's (jaxlib's Triton), so
counts may differ slightly from what runs; they explain what a profile cannot show, e.g. why the
"ptx" dequantization needs fewer instructions per K step than "shift" (BENCHMARKS.md "MXFP4
matmul"). Needs the package, which k3jax does not require:

  pip install triton==3.6.0      # the version of the GPU image
  python3 -m benchmarks.triton_sass --configs=n32_shift,n32_ptx --m=1 --k=3584 --n=3072
  python3 -m benchmarks.triton_sass --configs=n64_ptx --groups=8 --m=16 --keep_dir=/tmp/sass
  python3 -m benchmarks.triton_sass --op=gate_up --configs=default,n64_k64 --m=16 --groups=64 \
      --k=512 --n=512      # the fused gate/up, every one of 16 tokens on each of 64 experts

Prints one line per config and, with --sass_out, writes the counts as JSON records.
"""
import collections
import json
import pathlib
import re
import subprocess
import tempfile

from absl import app
from absl import flags
import jax
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir
from jax._src.lib.triton import dialect as tt_dialect
import jax.numpy as jnp

from pallas_kernels.mxfp4_matmul import triton as mx_triton

TARGET = "__gpu$xla.gpu.triton"
_CONFIGS = flags.DEFINE_list("configs", ["n32_ptx"], "Names in the tier's CONFIGS or "
                             "DECODE_CONFIGS, or 'default' (the tier's choice for the shape).")
_OP = flags.DEFINE_enum("op", "matmul", ["matmul", "gate_up"], "matmul: the dense (--groups 1) "
                        "or grouped product; gate_up: the fused gate/up (`triton.gate_up`) of "
                        "--m tokens, each on every one of --groups experts (W1, W3 [G, N, K]).")
_M = flags.DEFINE_integer("m", 1, "Rows of x.")
_K = flags.DEFINE_integer("k", 3584, "K (block_k is fitted to it).")
_N = flags.DEFINE_integer("n", 3072, "N.")
_GROUPS = flags.DEFINE_integer("groups", 1, "Experts: 1 is the dense matmul, more the grouped "
                               "one with equal groups.")
_ARCH = flags.DEFINE_integer("arch", 90, "Compute capability to compile for (90: sm_90a).")
_KEEP = flags.DEFINE_string("keep_dir", None, "Keep each config's .ttir / .ptx / .sass here.")
# Not "out": the tests import this module beside other benchmarks that define it.
_OUT = flags.DEFINE_string("sass_out", None, "Write the counts to this JSON file.")


def triton_modules(lowered) -> list[tuple[str, dict, str]]:
  """(kernel name, launch params, Triton module as text without locations) of each Triton custom
  call of a `jax.stages.Lowered` program."""
  found = []

  def visit(op):
    if (op.name == "stablehlo.custom_call"
        and ir.StringAttr(op.attributes["call_target_name"]).value == TARGET):
      attrs = ir.DictAttr(op.attributes["mhlo.backend_config"])
      named = {attrs[i].name: attrs[i].attr for i in range(len(attrs))}
      with mlir.make_ir_context() as ctx:
        tt_dialect.register_dialect(ctx)
        module = ir.Module.parse(ir.StringAttr(named["ir"]).value_bytes)
        text = module.operation.get_asm(enable_debug_info=False)
      params = {k: ir.IntegerAttr(v).value for k, v in named.items()
                if k in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z")}
      found.append((ir.StringAttr(named["name"]).value, params, text))
    return ir.WalkResult.ADVANCE

  lowered.compiler_ir("stablehlo").operation.walk(visit)
  return found


def lower(cfg: mx_triton.Config | None, m: int, k: int, n: int, groups: int,
          op: str = "matmul"):
  """The tier's call lowered for an H200."""
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="cuda")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device)
  s = lambda *shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype)
  lead = (groups,) if groups > 1 or op == "gate_up" else ()
  w = [s(*lead, n, k // 2, dtype=jnp.uint8), s(*lead, n, k // 32, dtype=jnp.uint8)]
  args = [s(m, k), *w]
  if op == "gate_up":
    args = [s(m, k), s(m * groups, dtype=jnp.int32), *w, *w, s(groups, dtype=jnp.int32)]
    fn = lambda x, rows, *ws: mx_triton.gate_up(x, rows, *ws, beta1=4.0, beta2=2.0, config=cfg)
  elif groups > 1:
    args.append(s(groups, dtype=jnp.int32))
    fn = lambda x, p, sc, gs: mx_triton.ragged_dot(x, p, sc, gs, config=cfg)
  else:
    fn = lambda x, p, sc: mx_triton.matmul(x, p, sc, config=cfg)
  with jax.sharding.use_abstract_mesh(mesh):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def sass_counts(sass: str) -> dict:
  """Instructions of a cuobjdump listing: in all, in the K loop's body (the largest innermost
  loop: a backward branch's span holding no other), and that body's opcodes."""
  lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
  addr = [int(re.match(r"\s+/\*([0-9a-f]+)\*/", l).group(1), 16) for l in lines]
  ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", l).split()[0].rstrip(";")
         for l in lines]
  spans = []
  for i, line in enumerate(lines):
    branch = re.search(r"\bBRA\s+(?:0x)?([0-9a-f]+)", line)
    if branch and int(branch.group(1), 16) in addr and int(branch.group(1), 16) < addr[i]:
      spans.append((addr.index(int(branch.group(1), 16)), i + 1))
  inner = [(a, b) for a, b in spans
           if not any((c, d) != (a, b) and a <= c and d <= b for c, d in spans)]
  start, end = max(inner, key=lambda span: span[1] - span[0], default=(0, 0))
  body = ops[start:end]
  opcodes = collections.Counter(op.split(".")[0] for op in body)
  return dict(sass_instructions=len(ops), loop_instructions=len(body),
              loop_opcodes=dict(opcodes.most_common()))


def compile_module(text: str, params: dict, arch: int, keep: pathlib.Path | None,
                   stem: str) -> dict:
  """The Triton module compiled by the `triton` package for sm_<arch>a: registers, shared bytes
  and `sass_counts`."""
  import triton                                   # pylint: disable=import-outside-toplevel
  from triton.backends.compiler import GPUTarget  # pylint: disable=import-outside-toplevel
  tool = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
  with tempfile.TemporaryDirectory() as tmp:
    work = keep or pathlib.Path(tmp)
    src = work / f"{stem}.ttir"
    src.write_text(text)
    kernel = triton.compile(str(src), target=GPUTarget("cuda", arch, 32),
                            options=dict(num_warps=params["num_warps"],
                                         num_stages=params["num_stages"]))
    ptx, cubin = work / f"{stem}.ptx", work / f"{stem}.cubin"
    ptx.write_text(kernel.asm["ptx"])
    info = subprocess.run([str(tool / "ptxas"), f"-arch=sm_{arch}a", "-v", str(ptx), "-o",
                           str(cubin)], capture_output=True, text=True, check=True).stderr
    sass = subprocess.run([str(tool / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                          text=True, check=True).stdout
    (work / f"{stem}.sass").write_text(sass)
  regs = re.search(r"Used (\d+) registers", info)
  return dict(registers=int(regs.group(1)) if regs else None,
              shared_bytes=kernel.metadata.shared, **sass_counts(sass))


def main(argv):
  del argv
  jax.config.update("jax_platforms", "cpu")   # lowering for an abstract H200 needs no device
  try:
    import triton  # noqa: F401  pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise app.UsageError("needs the `triton` package: pip install triton==3.6.0") from None
  configs = mx_triton.ALL_CONFIGS
  if unknown := set(_CONFIGS.value) - set(configs) - {"default"}:
    raise app.UsageError(f"--configs: unknown {sorted(unknown)}, choose from "
                         f"{['default', *configs]}")
  m, k, n, g = _M.value, _K.value, _N.value, _GROUPS.value
  keep = pathlib.Path(_KEEP.value) if _KEEP.value else None
  if keep:
    keep.mkdir(parents=True, exist_ok=True)
  records = []
  for name in _CONFIGS.value:
    cfg = None if name == "default" else mx_triton.fit(configs[name], k)
    [(kernel, params, text)] = triton_modules(lower(cfg, m, k, n, g, _OP.value))
    counts = compile_module(text, params, _ARCH.value, keep, f"{kernel}_{name}")
    rec = dict(kernel=kernel, config=name, op=_OP.value, shape=dict(M=m, K=k, N=n, G=g),
               arch=f"sm_{_ARCH.value}a", **params, **counts)
    records.append(rec)
    top = ", ".join(f"{op} {c}" for op, c in list(counts["loop_opcodes"].items())[:6])
    print(f"{name:24s} grid {params['grid_x']}x{params['grid_y']}x{params['grid_z']} "
          f"{params['num_warps']} warps  {counts['registers']} registers  "
          f"{counts['shared_bytes']} B shared  {counts['sass_instructions']} SASS, "
          f"{counts['loop_instructions']} in the K loop ({top})", flush=True)
  if _OUT.value:
    pathlib.Path(_OUT.value).write_text(json.dumps(records, indent=1) + "\n")


if __name__ == "__main__":
  app.run(main)
