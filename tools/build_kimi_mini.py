"""Rebuild models/kimi-mini/ from scratch: Kimi-K2.5's text architecture and layout, trained on the bundled chats.

    python tools/build_kimi_mini.py --bf16      # 45 minutes on 2 cores (0.37 steps/s; Intel Xeon with AMX, alone)
    python tools/build_kimi_mini.py             # float32, for CPUs without native bf16 (~1.5x slower a step;
                                                # the shipped build is --bf16)
    python tools/build_kimi_mini.py --steps 20  # a smoke build (fails its quality gate)
    python tools/build_kimi_mini.py --continue-from models/kimi-mini --steps 400 --lr 5e-4 --bf16  # train on

A build that fails its quality gate is still written (then the command exits 1): --continue-from goes on training it
from its shipped weights with a new warmup + cosine schedule; the model card lists every command of the chain.

All logic lives in tools.kimi_mini.
"""

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.kimi_mini import KIMI_MINI_DIR, KimiMiniSettings, build_kimi_mini


def main() -> None:
    defaults = KimiMiniSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=KIMI_MINI_DIR)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch intra-op threads")
    parser.add_argument("--continue-from", type=Path, default=None,
                        help="go on training this built kimi-mini (its shipped weights) instead of starting afresh")
    parser.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (only where the CPU has native bf16)")
    args = parser.parse_args()
    if args.bf16:
        from eagle3.support.dtypes import cpu_has_native_bf16

        if not cpu_has_native_bf16():
            parser.error("--bf16: this CPU has no native bf16 matmul (bf16 autocast would run ~20x slower); "
                         "build without --bf16")
    settings = KimiMiniSettings(steps=args.steps, seed=args.seed, threads=args.threads, lr=args.lr,
                                bf16_autocast=args.bf16)
    command = ("python tools/build_kimi_mini.py " + shlex.join(sys.argv[1:])).strip()
    build_kimi_mini(args.out, settings, command=command, continue_from=args.continue_from)


if __name__ == "__main__":
    main()
