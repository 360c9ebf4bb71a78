"""ExecuTorch's own Llama model (``examples/models/llama``), vendored for the ``convert`` contract test.

The executorch pip wheel does not ship ``examples/``, so ``export_llama`` cannot be installed from a
registry. These files are copied unchanged from pytorch/executorch at commit
cff6f4dd32e630945b7188512c1f2b4f102b05ad (BSD licence in LICENSE), except that absolute
``executorch.examples.models.llama.*`` imports became relative and ``quantize.py`` keeps only the
three classes ``pre_quantization.py`` imports. The test drives them the way ``export_llama``
does with ``--preq_mode 8da4w_output_8da8w --use_spin_quant native``.
"""
