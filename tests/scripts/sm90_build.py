"""Compile ``tl`` Triton kernels for sm_90 on a machine without a GPU; print what tests check.

Run by the tests in a process of their own (Triton's interpreter, on in the test process,
patches Triton's language module for the whole process)::

    python sm90_build.py SPEC.json

``SPEC.json``: ``{name: {"kernel": "module:attr", "types": {arg: type}, "constants":
{arg: value}, "aligned": [arg, ...], "num_warps": int, "num_stages": int}}``; arguments
not in ``types`` or ``constants`` are ``i32``. Pointers and the ``aligned`` integers are
taken as 16-byte aligned, as Triton specializes a launch on contiguous tensors. Prints one
JSON line: ``{name: {"shared": bytes, "spills": local-memory instructions, "ops": {SASS
opcode: count}}}``.
"""

import collections
import concurrent.futures
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(kernel, types: dict, constants: dict, aligned=(), num_warps: int = 4, num_stages: int = 3):
    names = list(inspect.signature(kernel.fn).parameters)
    signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if signature[n].startswith("*") or n in aligned}
    source = ASTSource(kernel, signature, {(names.index(k),): v for k, v in constants.items()}, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps,
                                                                                 num_stages=num_stages))


def full_sass(cubin: bytes) -> str:
    """``cuobjdump -sass`` of a cubin, every instruction (Triton's ``asm["sass"]`` drops those
    past the 4096th: its parser takes 4-digit addresses only)."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-sass", f.name], text=True)
    return "\n".join(m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s*([^;]*;)", listing))


def report(compiled) -> dict:
    sass = full_sass(compiled.asm["cubin"])
    opcode = r"^(?:@!?U?P[0-9T] )?([A-Z0-9]+(?:\.[A-Z0-9_]+)*)"
    ops = collections.Counter(m.group(1) for m in re.finditer(opcode, sass, re.M))
    return {"shared": compiled.metadata.shared, "spills": len(re.findall(r"\b(?:STL|LDL)(?:\.\w+)*\b", sass)),
            "ops": dict(ops)}


def build_one(s: dict) -> dict:
    module, attr = s["kernel"].split(":")
    kernel = getattr(importlib.import_module(module), attr)
    return report(build(kernel, s.get("types", {}), s.get("constants", {}), s.get("aligned", ()),
                        s.get("num_warps", 4), s.get("num_stages", 3)))


def main(path: str) -> None:
    with open(path) as f:
        spec = json.load(f)
    with concurrent.futures.ProcessPoolExecutor(os.cpu_count()) as pool:  # one build per core
        reports = pool.map(build_one, spec.values())
    print(json.dumps(dict(zip(spec, reports))))


if __name__ == "__main__":
    main(sys.argv[1])
