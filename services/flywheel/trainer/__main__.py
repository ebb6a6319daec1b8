"""`python -m flywheel.trainer [--config FILE]`."""

from flywheel.trainer.main import main

if __name__ == "__main__":
    raise SystemExit(main())
