"""Layer 1: TernGrad math on one tensor. No communication, no global state."""
from . import levels, sizes, squares
from .packing import (FORMATS, assemble, average_packed, decode_sums, HEADER_BYTES, Header, PayloadError, decode_average, encode, pack,
                      packed_size, parse_header, read_header, payload_size, unpack)
from .rng import stream_key, tensor_id, uniform24, uniform24_scalar
from .ternary import (Prepared, TensorStats, prepare, clip_threshold, expand_scalers, local_scalers, num_buckets,
                      tensor_stats, ternarize)

__all__ = [
    "levels", "sizes", "squares",
    "assemble", "average_packed", "decode_sums", "expand_scalers",
    "FORMATS", "HEADER_BYTES", "Header", "PayloadError", "decode_average", "encode", "pack",
    "packed_size", "parse_header", "read_header", "payload_size", "unpack", "stream_key", "tensor_id", "uniform24",
    "uniform24_scalar", "Prepared", "prepare", "TensorStats", "clip_threshold", "local_scalers", "num_buckets",
    "tensor_stats", "ternarize",
]
