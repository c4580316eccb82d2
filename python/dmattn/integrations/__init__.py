"""Integrations of dmattn into other libraries. Importing this package never imports them:

    import dmattn
    dmattn.integrations.transformers.register()   # needs Hugging Face transformers
"""

from . import transformers

__all__ = ["transformers"]
