"""Framework integrations, kept apart from the kernels: `cuflash.integrations.transformers`."""
