"""Plumbing shared by the book's scripts: launcher, script contract, reporting, plotting, tiny model and data.

Chapter scripts teach; this package only carries what they would otherwise repeat. Import the submodules directly
(`from mlsys import cli, launch`), so that `--help` stays fast and nothing heavy is imported by accident.
"""

__version__ = "0.1.0"
