"""python -m scripts.gpu_check [--dry-run] [--out gpu_check.json] [--only loss,transport]: the GPU check's command
(bash scripts/gpu_check.sh runs it; the package's docstring says what it checks)."""
import sys

from scripts.gpu_check.run import main

if __name__ == "__main__":
    sys.exit(main())
