"""lenext's Hydra configs, shipped in the package (``pkg://lenext.configs``): a folder per group, a YAML file
per choice."""
