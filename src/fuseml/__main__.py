"""``python -m fuseml``: the ``fuseml`` command line."""

from fuseml.apps.cli import main

if __name__ == "__main__":
    main()
