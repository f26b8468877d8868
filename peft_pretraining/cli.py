"""The command-line parser every entry point uses: a bad flag is one line naming it, never a usage block."""
import argparse


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block): `<tool>: error: --flag ...`, exit code 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")
