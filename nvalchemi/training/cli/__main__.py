"""``python -m nvalchemi.training.cli``: the ``nvalchemi-training`` command."""

from nvalchemi.app.cli import main

if __name__ == "__main__":
    main(prog_name="nvalchemi-training")
