"""`python -m jaxtron <command>`: the `jaxtron` command (jaxtron/cli.py)."""

if __name__ == "__main__":
    import sys

    from jaxtron.cli import main
    sys.exit(main())
