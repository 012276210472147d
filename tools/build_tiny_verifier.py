"""Rebuild the bundled tiny chat verifier from scratch: data/stdlib-chat/ and models/tiny-chat-verifier/.

    python tools/build_tiny_verifier.py               # data + tokenizer + model (about 15-30 min on 2 cores)
    python tools/build_tiny_verifier.py --data-only   # data + tokenizer only (seconds)

All logic lives in tools.tiny_verifier.
"""

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tools.tiny_verifier import DEFAULT_DATA_DIR, DEFAULT_MODEL_DIR, TrainSettings, build_tiny_verifier


def main() -> None:
    defaults = TrainSettings()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA_DIR)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--data-only", action="store_true", help="write data and tokenizer, train no model")
    parser.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=defaults.threads, help="torch intra-op threads")
    args = parser.parse_args()
    settings = TrainSettings(steps=args.steps, seed=args.seed, threads=args.threads)
    command = "python tools/build_tiny_verifier.py " + shlex.join(sys.argv[1:])
    build_tiny_verifier(
        args.data_dir, args.model_dir, settings, train_model=not args.data_only, command=command.strip()
    )


if __name__ == "__main__":
    main()
