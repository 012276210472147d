"""Rebuild models/kimi-mini/ from scratch: Kimi-K2.5's text architecture and layout, trained on the bundled chats.

    python tools/build_kimi_mini.py             # about 40 minutes on 2 cores
    python tools/build_kimi_mini.py --steps 20  # a smoke build (fails its quality gate)

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
    args = parser.parse_args()
    settings = KimiMiniSettings(steps=args.steps, seed=args.seed, threads=args.threads)
    command = ("python tools/build_kimi_mini.py " + shlex.join(sys.argv[1:])).strip()
    build_kimi_mini(args.out, settings, command=command)


if __name__ == "__main__":
    main()
