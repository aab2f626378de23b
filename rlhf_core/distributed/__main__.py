"""`python -m rlhf_core.distributed build-ops`: build DeepSpeed's just-in-time ops into this
environment's cache (`deepspeed_engine.extensions_dir`), once, at set-up time."""
import sys

from rlhf_core.distributed.deepspeed_engine import build_deepspeed_ops, extensions_dir

if __name__ == "__main__":
    if sys.argv[1:] != ["build-ops"]:
        sys.exit("usage: python -m rlhf_core.distributed build-ops")
    seconds = build_deepspeed_ops()
    print(f"DeepSpeed ops ready in {extensions_dir()} ({seconds:.1f} s)")
