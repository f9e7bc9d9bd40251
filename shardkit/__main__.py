"""``python -m shardkit ...`` runs the command-line tool (also under torchrun for scale-out)."""

from shardkit.cli.main import main

if __name__ == "__main__":
    main()
