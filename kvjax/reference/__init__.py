"""Pure-jnp references: the oracle every kernel is tested against."""
from kvjax.reference.attention import unified_attention
from kvjax.reference.cache_update import encode_rows, write_kv

__all__ = ["unified_attention", "write_kv", "encode_rows"]
