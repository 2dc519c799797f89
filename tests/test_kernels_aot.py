"""Every Triton kernel compiles (not interpreted) to a cubin for sm_80 and sm_90, no GPU needed.

The rest of the suite runs the kernels under TRITON_INTERPRET=1, which accepts constructs that
compiled Triton may reject (and the other way round); this lowers each one through the installed
Triton's real pipeline and ptxas. A subprocess, since the interpreter flag is read at import.
"""

import os
import subprocess
import sys

import pytest

# make test-compat runs this file on the oldest torch: Triton's ahead-of-time compiler
pytestmark = pytest.mark.compat

@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "memtrain.kernels.aot"], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    built = {(name, arch) for name, arch, *_ in lines}
    names = {"_block_score_kernel", "_block_compact_kernel", "_bsr_grad_weight_kernel",
             "_pack_kernel", "_masked_grad_kernel", "_quant_pack_kernel",
             "_unpack_dequant_kernel"}
    assert built == {(n, f"sm_{a}:") for n in names for a in (80, 90)}
    assert all(int(size) > 0 for *_, size, _unit in lines)
