"""kvexport: ship an HSTU ranking model with a user-history KV cache as an AOTInductor package."""

__version__ = "0.1.0"
