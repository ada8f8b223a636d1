"""Compile Triton kernels for sm_90 (the H200) on a machine without a GPU, and read their global accesses.

Triton's NVIDIA backend (and the ptxas its wheel ships) compiles for any target offline, so how a tile
load is vectorized and whether a loop's loads became asynchronous copies (software pipelined) can be
checked in CPU CI. Compiles run in one child process without TRITON_INTERPRET (under the interpreter,
@triton.jit yields interpreted functions that cannot be compiled). Arguments are specialized the way a
launch on contiguous tensors specializes them: pointers and the listed integers divisible by 16, unit
strides equal to 1.

  python -m moe_lora_harness.suites.kernels.sm90_codegen < jobs.json   # {name: job} -> {name: ttgir} on stdout
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass

import moe_lora_harness

# where a child interpreter finds the package (a source tree or site-packages)
PACKAGE_PARENT = pathlib.Path(moe_lora_harness.__file__).resolve().parents[1]
SM90 = (90, 32)  # (compute capability, warp size)
ID_POINTERS = frozenset({"sorted_ptr", "expert_ptr", "ntpp_ptr", "map_ptr", "lora_ids_ptr", "enabled_ptr",
                         "ids_ptr", "expert_ids_ptr", "perm_ptr", "count_ptr"})
FP32_POINTERS = frozenset({"w_ptr", "ws_ptr", "tw_ptr"})
DIVISIBLE = frozenset({"N", "K", "R", "em", "EM", "n_per_prog", "k_per_split", "col0"})


def job(fn: str, constexprs: dict, *, unit_strides=(), pointer_types=None, num_warps=4, num_stages=3,
        maxnreg=None, elem="bf16") -> dict:
    """One compile: `fn` is "module:attr" of a @triton.jit kernel; see compile_one."""
    return dict(fn=fn, constexprs=constexprs, unit_strides=list(unit_strides), pointer_types=pointer_types or {},
                num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg, elem=elem)


def ttgir_sm90(jobs: dict, timeout: float = 600) -> dict:
    """{name: job} -> {name: TTGIR text}, compiled in one child process (raises with its stderr on failure)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_PARENT)]
                                        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, "-m", "moe_lora_harness.suites.kernels.sm90_codegen"], input=json.dumps(jobs), text=True,
                          capture_output=True, env=env, cwd=PACKAGE_PARENT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"sm_90 compile failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def unavailable_reason() -> str | None:
    """Why sm_90 code cannot be generated here (None: it can)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        return f"this Triton cannot compile offline ({e})"
    try:
        import triton.backends.nvidia  # noqa: F401
    except ImportError as e:
        return f"triton {triton.__version__} has no NVIDIA backend ({e})"
    return None


def compile_one(spec: dict) -> str:
    """TTGIR of one job (run in the child): constexprs by name, unit strides specialized to 1, pointers typed
    `elem` unless they are id / fp32 pointers or given in pointer_types."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    mod, attr = spec["fn"].split(":")
    fn = getattr(importlib.import_module(mod), attr)
    names = list(fn.arg_names)
    consts = dict(spec["constexprs"])
    sig, attrs = {}, {}
    for i, (name, param) in enumerate(zip(names, fn.params)):
        if param.is_constexpr:
            if name not in consts:
                raise ValueError(f"constexpr {name} of {spec['fn']} needs a value")
            sig[name] = "constexpr"
        elif name in spec["unit_strides"]:
            sig[name] = "constexpr"
            consts[name] = 1
        elif name.endswith("_ptr"):
            sig[name] = spec["pointer_types"].get(name) or (
                "*i32" if name in ID_POINTERS else "*fp32" if name in FP32_POINTERS else f"*{spec['elem']}")
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "i32"
            if name.startswith("stride_") or name in DIVISIBLE:
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs)
    options = dict(num_warps=spec["num_warps"], num_stages=spec["num_stages"])
    if spec["maxnreg"]:
        options["maxnreg"] = spec["maxnreg"]
    return triton.compile(src, target=GPUTarget("cuda", *SM90), options=options).asm["ttgir"]


@dataclass(frozen=True)
class Access:
    """One 2-D global access in the TTGIR: op (load | store | async_copy: a software-pipelined load), tile
    shape, element type, and elements per thread along the tile's fastest-varying dimension."""

    op: str
    shape: tuple
    dtype: str
    vector: int

    @property
    def vector_bytes(self) -> int:
        return self.vector * {"bf16": 2, "f16": 2, "f32": 4, "i32": 4, "i64": 8}.get(self.dtype, 1)


_LAYOUT = re.compile(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\].*?order = \[([\d, ]+)\]", re.M)
_ACCESS = re.compile(r"(tt\.load|tt\.store|ttg\.async_copy_global_to_local) .*?: "
                     r"tensor<(\d+)x(\d+)x!tt\.ptr<(\w+)>, (#blocked\d*)>")


def global_accesses(ttgir: str) -> list[Access]:
    """Every 2-D global load / store / async copy of a TTGIR module, in program order."""
    fastest = {}
    for name, spt, order in _LAYOUT.findall(ttgir):
        fastest[name] = [int(x) for x in spt.split(",")][int(order.split(",")[0])]
    out = []
    for m in _ACCESS.finditer(ttgir):
        if m.group(5) in fastest:
            op = {"tt.load": "load", "tt.store": "store"}.get(m.group(1), "async_copy")
            out.append(Access(op, (int(m.group(2)), int(m.group(3))), m.group(4), fastest[m.group(5)]))
    return out


try:  # a probe kernel for the check's own test (only compiled in the child, where it is a JITFunction)
    import triton
    import triton.language as tl

    @triton.jit
    def rank_offset_probe(b_ptr, out_ptr, N, stride_bn, stride_br, stride_on, RANK: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, CLAMP: tl.constexpr):
        """Streams a rank-contiguous B (N, RANK) through (BLOCK_R, BLOCK_N) tiles as the one-shot expand does;
        CLAMP clamps the rank offsets as that kernel did before 2026-11-29."""
        offs_r = tl.arange(0, BLOCK_R)
        rmask = offs_r < RANK
        r = offs_r
        if CLAMP:
            r = tl.where(rmask, offs_r, 0)
        offs_n = tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + offs_n
            bt = tl.load(b_ptr + r[:, None] * stride_br + cols[None, :] * stride_bn,
                         mask=rmask[:, None] & (cols < N)[None, :], other=0.0)
            acc += tl.sum(bt.to(tl.float32), axis=1)
        tl.store(out_ptr + offs_r * stride_on, acc.to(out_ptr.dtype.element_ty))
except ImportError:  # pragma: no cover
    pass


if __name__ == "__main__":
    jobs = json.loads(sys.stdin.read())
    json.dump({name: compile_one(spec) for name, spec in jobs.items()}, sys.stdout)
