"""Triton kernels of spec_ext, one module per family; each registers its ops under the
``spec_ext_triton`` namespace with ``torch.library.triton_op`` so they compose with
``torch.compile``. Imported lazily by ``spec_ext.ops`` (Triton is optional); ``launch``, the
launchers' table, imports only torch."""
