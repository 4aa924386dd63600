"""The package's modules and files; everything else (metadata, dependencies, extras) is in setup.cfg.

The repository's ``configs/`` is installed as ``jaxtron/configs/`` (``jaxtron.config.loader.shipped_configs``), so
that ``jaxtron train --config=llama3_8b`` finds a shipped config from any directory of any install."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["jaxtron", "jaxtron.*"]), "jaxtron.configs"],
      package_dir={"jaxtron.configs": "configs"})
