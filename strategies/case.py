"""The case model: one frozen dataclass that fully determines a kernel call.

A ``Case`` holds the static configuration (shape bucket, heads, dtypes), the ragged layout (one
``(q_len, kv_len)`` pair per live sequence), the keyword options (inherited from ``spec.Options``, so an
option added to the specification is a field here and is passed by ``options()`` without an edit), and
how to fill the arrays (a seed, a value profile and scale, the padding). Arrays are built from it with
NumPy alone, so strategies never touch JAX and a failing case can be rebuilt exactly from its ``repr`` or
its JSON. Every test and benchmark builds its inputs here.
"""

import dataclasses
import json
import math

import ml_dtypes
import numpy as np

from rpa_harness.spec.interface import ALL_OPTION_NAMES, OPTION_DEFAULTS, Options

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
}

# Standard deviation of the drawn values for each profile; "ties" draws from {-1, 0, 1} instead.
VALUE_PROFILES = {
    "normal": 1.0,  # unit scale: the case tolerances are stated for
    "large": 6.0,  # logits in the hundreds: overflows a softmax without max subtraction
    "ties": 1.0,  # many exactly equal logits
    "tiny": 1e-3,  # nearly uniform softmax
}

INT32 = np.iinfo(np.int32)


@dataclasses.dataclass(frozen=True, repr=False)
class Case(Options):
    """One kernel call: static shapes, ragged layout, options (keyword-only, from ``Options``) and data."""

    # Static shape bucket.
    max_num_batched_tokens: int
    max_num_seqs: int
    pages_per_seq: int
    total_num_pages: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    # Latent attention (MLA, absorbed): the value is the key's first value_head_dim dims, the rest of it
    # zero (rpa_harness.spec.interface.VALUE_IS_KEY_PREFIX). None: key and value are drawn apart.
    value_head_dim: int | None = None
    q_dtype: str = "float32"
    kv_dtype: str = "float32"
    # Ragged layout: one entry per live sequence (num_seqs = len(q_lens)).
    q_lens: tuple[int, ...] = ()
    kv_lens: tuple[int, ...] = ()
    # Data.
    seed: int = 0
    values: str = "normal"
    kv_value_scale: float = 1.0  # multiplies the drawn K/V values (puts an fp8 cache in its range)
    poison: bool = True  # NaN in page tails, unused pages and padding query rows
    garbage: bool = False  # arbitrary int32 in unused metadata slots (kv_lens kept within the page table)
    # Explicit garbage: unused page-table entries and metadata slots past num_seqs cycle through these
    # int32 values (instead of drawn ones). They may break upstream's page check, which reads every kv_lens
    # slot: for calls of the kernel alone.
    garbage_values: tuple[int, ...] = ()

    def __post_init__(self):
        if len(self.q_lens) != len(self.kv_lens):
            raise ValueError(
                f"q_lens {self.q_lens} and kv_lens {self.kv_lens} must have one entry per sequence"
            )
        if self.values not in VALUE_PROFILES:
            raise ValueError(f"values={self.values!r} must be one of {sorted(VALUE_PROFILES)}")
        if any(not INT32.min <= value <= INT32.max for value in self.garbage_values):
            raise ValueError(f"garbage_values={self.garbage_values} must all fit in int32")
        if self.value_head_dim is not None and not 0 < self.value_head_dim <= self.head_dim:
            raise ValueError(
                f"value_head_dim={self.value_head_dim} must be in (0, head_dim={self.head_dim}] or None"
            )

    def __repr__(self):
        """Evaluable, in reading order: shapes and layout, then the options that are set, then the data."""
        own = [
            f.name
            for f in dataclasses.fields(self)
            if f.name not in ALL_OPTION_NAMES
            and not (f.name == "value_head_dim" and self.value_head_dim is None)
        ]
        data = own.index("seed")
        names = own[:data] + [n for n in ALL_OPTION_NAMES if n in self.options()] + own[data:]
        return f"Case({', '.join(f'{name}={getattr(self, name)!r}' for name in names)})"

    def _repr_pretty_(self, printer, cycle: bool) -> None:  # Hypothesis's printer would list every field
        printer.text(repr(self))

    @property
    def num_seqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def kv_capacity(self) -> int:
        """Longest kv_len the page table can hold."""
        return self.pages_per_seq * self.page_size

    @property
    def block_steps(self) -> int:
        """An upper bound on the (query block, KV block) pairs a blocked kernel visits: per sequence
        ``cdiv(q_len, bq) * cdiv(kv_len, bkv)``, a block size left to the kernel counted as one query row
        or one page. The TPU interpreter's cost grows with it (each pair is DMAs and a grid step)."""
        rows = self.num_queries_per_block or 1
        keys = (self.num_kv_pages_per_block or 1) * self.page_size
        return sum(
            -(-q_len // rows) * -(-kv_len // keys)
            for q_len, kv_len in zip(self.q_lens, self.kv_lens, strict=True)
        )

    def options(self) -> dict:
        """Keyword options that differ from the defaults (what a caller would pass); extension options
        (``rpa_harness.spec.interface.EXTENSION_NAMES``) appear only when set, i.e. for targets that declare them."""
        return {
            name: getattr(self, name)
            for name in ALL_OPTION_NAMES
            if getattr(self, name) != getattr(OPTION_DEFAULTS, name)
        }

    def array_shapes(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """The shape and dtype of each of ``arrays()``, without building them (a production cache is
        hundreds of MiB; compiling for a chip needs only these)."""
        slots, int32 = self.max_num_seqs, np.dtype(np.int32)
        return {
            "q": ((self.max_num_batched_tokens, self.num_q_heads, self.head_dim), DTYPES[self.q_dtype]),
            "kv_pages": (
                (self.total_num_pages, self.page_size, 2 * self.num_kv_heads, self.head_dim),
                DTYPES[self.kv_dtype],
            ),
            "kv_lens": ((slots,), int32),
            "page_indices": ((slots, self.pages_per_seq), int32),
            "cu_q_lens": ((slots + 1,), int32),
            "num_seqs": ((1,), int32),
        }

    def arrays(self) -> dict[str, np.ndarray]:
        """The six inputs as NumPy arrays, deterministic in the case (seed included)."""
        # Separate streams, so that the padding switches never change the live data.
        pages_rng, values_rng, garbage_rng = (np.random.default_rng((self.seed, i)) for i in range(3))
        n, max_seqs = self.num_seqs, self.max_num_seqs
        kv_lens = np.zeros(max_seqs, np.int32)
        kv_lens[:n] = self.kv_lens
        cu_q_lens = np.full(max_seqs + 1, self.num_tokens, np.int32)
        cu_q_lens[: n + 1] = np.concatenate([[0], np.cumsum(self.q_lens, dtype=np.int64)])
        page_indices = np.zeros((max_seqs, self.pages_per_seq), np.int32)
        pages_used = [math.ceil(kv / self.page_size) for kv in self.kv_lens]
        if sum(pages_used) > self.total_num_pages:
            raise ValueError(
                f"the layout needs {sum(pages_used)} pages but total_num_pages={self.total_num_pages}; "
                "draw fewer or shorter sequences"
            )
        permutation = pages_rng.permutation(self.total_num_pages).astype(np.int32)
        used_pages = np.split(permutation[: sum(pages_used)], np.cumsum(pages_used)[:-1])
        for i, pages in enumerate(used_pages[:n]):
            page_indices[i, : len(pages)] = pages
        if self.garbage_values:

            def cycled(size):
                return np.resize(np.asarray(self.garbage_values, np.int32), size)

            for i in range(max_seqs):
                start = pages_used[i] if i < n else 0
                page_indices[i, start:] = cycled(self.pages_per_seq - start)
            kv_lens[n:] = cycled(max_seqs - n)
            cu_q_lens[n + 1 :] = cycled(max_seqs - n)
        elif self.garbage:
            # Unused slots hold either arbitrary int32 or stale, in-range metadata as an earlier batch left
            # it (one coin per case): stale rows and pages overlap the live ones, which catches a kernel that
            # reads past num_seqs.
            stale = garbage_rng.random() < 0.5

            def garbage(size, stale_high):
                return (
                    garbage_rng.integers(0, stale_high + 1, size)
                    if stale
                    else garbage_rng.integers(INT32.min, INT32.max, size)
                )

            for i in range(max_seqs):
                start = pages_used[i] if i < n else 0
                page_indices[i, start:] = garbage(self.pages_per_seq - start, self.total_num_pages - 1)
            kv_low = 0 if stale else -self.kv_capacity  # upstream's page check reads every kv_lens slot
            kv_lens[n:] = garbage_rng.integers(kv_low, self.kv_capacity + 1, max_seqs - n)
            cu_q_lens[n + 1 :] = np.sort(garbage(max_seqs - n, self.num_tokens))  # stale: over live rows

        shapes = self.array_shapes()
        q_shape, kv_shape = shapes["q"][0], shapes["kv_pages"][0]
        live = np.zeros(kv_shape[:2], bool)  # (page, slot) pairs holding a key of a live sequence
        for pages, kv_len in zip(used_pages[:n], self.kv_lens, strict=True):
            live.reshape(-1)[(pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)] = (
                np.arange(len(pages) * self.page_size) < kv_len
            )
        # Only live rows and keys are drawn (the padding switches cannot change them); the rest holds NaN
        # (poison) or, like memory an earlier batch left behind, copies of live values.
        q = self._padded(
            self._values(values_rng, (self.num_tokens, *q_shape[1:]), self.q_dtype),
            np.arange(q_shape[0]) < self.num_tokens,
        )
        kv_pages = self._padded(
            self._values(values_rng, (int(live.sum()), *kv_shape[2:]), self.kv_dtype, self.kv_value_scale),
            live,
        )
        if self.value_head_dim is not None:  # every slot, padding included: V = [K[:d] ; 0]
            d = self.value_head_dim
            kv_pages[:, :, 1::2, :d] = kv_pages[:, :, 0::2, :d]
            kv_pages[:, :, 1::2, d:] = 0
        return {
            "q": q,
            "kv_pages": kv_pages,
            "kv_lens": kv_lens,
            "page_indices": page_indices,
            "cu_q_lens": cu_q_lens,
            "num_seqs": np.array([n], np.int32),
        }

    def _values(self, rng, shape, dtype_name, scale=1.0):
        if self.values == "ties":
            data = rng.integers(-1, 2, shape).astype(np.float32)
        else:
            data = rng.standard_normal(shape, dtype=np.float32) * np.float32(VALUE_PROFILES[self.values])
        if scale != 1.0:
            data = data * np.float32(scale)
        return data.astype(DTYPES[dtype_name])

    def _padded(self, values: np.ndarray, is_live: np.ndarray) -> np.ndarray:
        """``values`` at the True positions of ``is_live`` (the leading axes), padding at the others."""
        shape = is_live.shape + values.shape[1:]
        if self.poison:
            # NaN written through an integer view: filling ml_dtypes arrays directly is ~30x slower.
            out = np.empty(shape, values.dtype)
            bits = np.dtype(f"u{values.dtype.itemsize}")
            out.view(bits)[...] = np.array(np.nan, values.dtype).view(bits)
        else:
            out = np.empty(shape, values.dtype)
            dead = int(is_live.size - len(values))
            # Copies of the live values, cycled in order over the dead positions (zeros if none is live).
            out[~is_live] = np.resize(values, (dead, *values.shape[1:])) if len(values) else 0
        out[is_live] = values
        return out

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        fields = json.loads(text)
        fields["q_lens"] = tuple(fields["q_lens"])
        fields["kv_lens"] = tuple(fields["kv_lens"])
        fields["garbage_values"] = tuple(fields.get("garbage_values", ()))
        if fields.get("attention_sink") is not None:
            fields["attention_sink"] = tuple(float(x) for x in fields["attention_sink"])
        return cls(**fields)

    def describe(self) -> str:
        """One line for reports: the layout and what is switched on."""
        seqs = ", ".join(f"({q},{kv})" for q, kv in zip(self.q_lens, self.kv_lens, strict=True))
        return (
            f"{self.num_seqs} seqs [(q_len,kv_len): {seqs}] T={self.max_num_batched_tokens} "
            f"heads={self.num_q_heads}/{self.num_kv_heads} head_dim={self.head_dim}"
            f"{'' if self.value_head_dim is None else f' value_head_dim={self.value_head_dim}'} "
            f"page_size={self.page_size} "
            f"pages_per_seq={self.pages_per_seq} q={self.q_dtype} kv={self.kv_dtype} values={self.values} "
            f"options={self.options()}"
        )
