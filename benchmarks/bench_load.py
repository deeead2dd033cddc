"""Fill the host store before or after page-locking it: which is faster (and what it costs in peak RSS).

Writes a 7B-class bf16 HF directory layer by layer, then loads it with megatrain.from_pretrained twice,
in fresh child processes: MEGATRAIN_PIN_AFTER_FILL=1 (map, fill, then one cudaHostRegister: the default)
and =0 (register at allocation, every page faulted in first, then fill). Reports load time, read GB/s
and peak RSS vs store size for each. JSON: docs/benchmarks/scale_load_h200.json.

  python benchmarks/bench_load.py [--dir DIR] [--small]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

if __name__ == "__main__":
    import bench_scale
    sys.argv = [sys.argv[0], "load", "--pin-after-fill", "both"] + sys.argv[1:]
    bench_scale.main()
