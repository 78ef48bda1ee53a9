"""The package's built extension (``csrc/``, built by ``setup.py``): importing it registers the ops
``torch.ops.tdb_native``; the module itself holds nothing (see :mod:`torchrec_dtensor_bridge.kernels.native`)."""
