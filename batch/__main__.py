"""``python -m batch``: the main job (``batch.cli``)."""
from batch.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
