//! Writes into key/value caches, moves between them, and attention over them.

use crate::cpu;
use crate::cuda::{self, Buffer};
use crate::kv::{KvRing, RingStorage};
use crate::tensor::Storage;
use crate::{Positions, Tensor};

use super::{check, mismatch, Result};

/// A layer's cached keys and values as attention reads them: `[kv_heads, capacity, head_dim]`
/// each, position `p` in slot `p % capacity`, positions `start..end` present.
pub struct KvView<'a> {
    pub keys: &'a KvRing,
    pub values: &'a KvRing,
    pub kv_heads: usize,
    pub capacity: usize,
    pub start: usize,
    pub end: usize,
    /// `Some(w)`: a sliding window; a query sees the `w` positions ending at its own.
    pub window: Option<usize>,
}

/// Writes `src` (`[tokens, kv_heads · head_dim]`) into a host ring at positions `first..`.
fn write_host_ring(
    ring: &mut KvRing,
    src: &[f32],
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    first: usize,
) -> Result<()> {
    ring.check_head_dim(head_dim)?;
    match &mut ring.storage {
        RingStorage::HostF32(c) => {
            cpu::attention::kv_write(c, src, kv_heads, head_dim, capacity, first)
        }
        RingStorage::HostF16(c) => {
            cpu::attention::kv_write(c, src, kv_heads, head_dim, capacity, first)
        }
        RingStorage::HostQuant(q) => {
            let cache = (&mut q.codes[..], &mut q.scales[..], &mut q.biases[..]);
            let quant = q.quant;
            cpu::attention::kv_write_quant(cache, quant, src, kv_heads, head_dim, capacity, first)
        }
        RingStorage::Cuda(_) => return Err(mismatch("kv_write")),
    }
    Ok(())
}

/// Writes `keys` and `values` (`[tokens, kv_heads · head_dim]` each) of the tokens at
/// `positions` (consecutive) into a cache's two rings, `cache.0` and `cache.1`
/// (`[kv_heads, capacity, head_dim]`, position `p` in slot `p % capacity`); one launch on a GPU.
pub fn kv_write(
    cache: (&mut KvRing, &mut KvRing),
    keys: &Tensor,
    values: &Tensor,
    kv_heads: usize,
    head_dim: usize,
    capacity: usize,
    positions: &Positions,
) -> Result<()> {
    let row = kv_heads * head_dim;
    let p = positions.as_slice();
    check(
        cache.0.len() == capacity * row
            && cache.1.len() == capacity * row
            && keys.len() == p.len() * row
            && values.len() == p.len() * row
            && p.len() <= capacity
            && p.windows(2).all(|w| w[1] == w[0] + 1),
        || {
            format!(
                "writing {:?} and {:?} into a cache of {capacity} × {row}",
                keys.shape(),
                values.shape()
            )
        },
    )?;
    if p.is_empty() {
        return Ok(());
    }
    match (&keys.storage, &values.storage) {
        (Storage::Host(k), Storage::Host(v)) => {
            write_host_ring(cache.0, k, kv_heads, head_dim, capacity, p[0])?;
            write_host_ring(cache.1, v, kv_heads, head_dim, capacity, p[0])
        }
        (Storage::Cuda(k), Storage::Cuda(v)) => {
            cache.0.check_head_dim(head_dim)?;
            match (&mut cache.0.storage, &mut cache.1.storage) {
                (RingStorage::Cuda(kc), RingStorage::Cuda(vc))
                    if kc.precision() == vc.precision()
                        && [vc.gpu(), k.gpu(), v.gpu()]
                            .iter()
                            .all(|g| kc.gpu().same(g)) =>
                {
                    cuda::attention::kv_write(
                        [kc, vc],
                        [k, v],
                        kv_heads,
                        head_dim,
                        capacity,
                        positions.on_gpu()?,
                    )
                }
                _ => Err(mismatch("kv_write")),
            }
        }
        _ => Err(mismatch("kv_write")),
    }
}

/// [`kv_write`] of one token for each of several sequences: row `i` of `keys` and `values`
/// (`[sequences, kv_heads · head_dim]`) into the rings `key_rings[i]` and `value_rings[i]`
/// (`[kv_heads, capacities[i], head_dim]`) at `positions[i]`, in one launch on a GPU.
#[allow(clippy::too_many_arguments)]
pub fn kv_write_batch(
    key_rings: &mut [&mut KvRing],
    value_rings: &mut [&mut KvRing],
    capacities: &[usize],
    keys: &Tensor,
    values: &Tensor,
    kv_heads: usize,
    head_dim: usize,
    positions: &Positions,
) -> Result<()> {
    let row = kv_heads * head_dim;
    let n = key_rings.len();
    check(
        value_rings.len() == n
            && capacities.len() == n
            && positions.len() == n
            && keys.len() == n * row
            && values.len() == n * row
            && key_rings
                .iter()
                .chain(value_rings.iter())
                .zip(capacities.iter().chain(capacities))
                .all(|(c, &cap)| cap > 0 && c.len() == cap * row),
        || {
            format!(
                "writing {:?} into {n} caches of {capacities:?} × {row}",
                keys.shape()
            )
        },
    )?;
    match (&keys.storage, &values.storage) {
        (Storage::Host(k), Storage::Host(v)) => {
            let rings = key_rings.iter_mut().zip(value_rings.iter_mut());
            for (i, (kr, vr)) in rings.enumerate() {
                let (p, cap) = (positions.as_slice()[i], capacities[i]);
                let rows = i * row..(i + 1) * row;
                write_host_ring(kr, &k[rows.clone()], kv_heads, head_dim, cap, p)?;
                write_host_ring(vr, &v[rows], kv_heads, head_dim, cap, p)?;
            }
            Ok(())
        }
        (Storage::Cuda(kb), Storage::Cuda(vb)) if kb.gpu().same(vb.gpu()) => {
            if let Some(ring) = key_rings.first() {
                ring.check_head_dim(head_dim)?;
            }
            // Key rings' addresses, then value rings', all of one precision.
            let precision = key_rings.first().map(|r| r.precision());
            let ptrs = key_rings
                .iter()
                .chain(value_rings.iter())
                .map(|c| match &c.storage {
                    RingStorage::Cuda(r)
                        if r.gpu().same(kb.gpu()) && Some(r.precision()) == precision =>
                    {
                        Ok(r.ptr())
                    }
                    _ => Err(mismatch("kv_write_batch")),
                })
                .collect::<Result<Vec<u64>>>()?;
            cuda::attention::kv_write_batch(
                &ptrs,
                precision.unwrap_or_default(),
                capacities,
                [kb, vb],
                kv_heads,
                head_dim,
                positions.on_gpu()?,
            )
        }
        _ => Err(mismatch("kv_write_batch")),
    }
}

/// Copies positions `positions` from a ring of `src_capacity` slots to one of `dst_capacity`
/// of the same precision.
pub fn kv_move(
    src: &KvRing,
    src_capacity: usize,
    dst: &mut KvRing,
    dst_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: std::ops::Range<usize>,
) -> Result<()> {
    let first = positions.start;
    let (h, d) = (kv_heads, head_dim);
    kv_copy(src, src_capacity, first, dst, dst_capacity, h, d, positions)
}

/// [`kv_move`] from other positions: position `p` of `positions` in `dst` takes position
/// `src_first + (p - positions.start)` of `src`.
#[allow(clippy::too_many_arguments)]
pub fn kv_copy(
    src: &KvRing,
    src_capacity: usize,
    src_first: usize,
    dst: &mut KvRing,
    dst_capacity: usize,
    kv_heads: usize,
    head_dim: usize,
    positions: std::ops::Range<usize>,
) -> Result<()> {
    let row = kv_heads * head_dim;
    check(
        src.len() == src_capacity * row && dst.len() == dst_capacity * row,
        || "kv_move between caches of other shapes".into(),
    )?;
    let (h, d, p, f) = (kv_heads, head_dim, positions.clone(), src_first);
    match (&src.storage, &mut dst.storage) {
        (RingStorage::HostF32(s), RingStorage::HostF32(t)) => {
            cpu::attention::kv_copy(s, src_capacity, f, t, dst_capacity, h, d, p);
            Ok(())
        }
        (RingStorage::HostF16(s), RingStorage::HostF16(t)) => {
            cpu::attention::kv_copy(s, src_capacity, f, t, dst_capacity, h, d, p);
            Ok(())
        }
        (RingStorage::HostQuant(s), RingStorage::HostQuant(t)) if s.quant == t.quant => {
            let (bytes, groups) = (s.quant.row_bytes(d), d / s.quant.group);
            let (sc, dc) = (src_capacity, dst_capacity);
            cpu::attention::kv_copy(&s.codes, sc, f, &mut t.codes, dc, h, bytes, p.clone());
            cpu::attention::kv_copy(&s.scales, sc, f, &mut t.scales, dc, h, groups, p.clone());
            cpu::attention::kv_copy(&s.biases, sc, f, &mut t.biases, dc, h, groups, p);
            Ok(())
        }
        (RingStorage::Cuda(s), RingStorage::Cuda(t))
            if s.gpu().same(t.gpu()) && s.precision() == t.precision() =>
        {
            let (p0, p1) = (p.start, p.end);
            cuda::attention::kv_move(s, src_capacity, f, t, dst_capacity, h, d, p0, p1)
        }
        _ => Err(mismatch("kv_move")),
    }
}

/// What attention does to its scores besides the softmax: the scale of each query·key dot
/// product, and optionally Gemma 2's soft cap and gpt-oss's sinks. Both options off is plain
/// scaled dot-product attention, at no extra cost.
#[derive(Clone, Copy)]
pub struct AttentionOptions<'a> {
    /// What each query·key dot product is multiplied by.
    pub scale: f32,
    /// `Some(cap)` (positive): each scaled score `s` becomes `cap · tanh(s / cap)` before the
    /// mask and the softmax (Gemma 2's `attn_logit_softcapping`; mlx-lm scales the queries,
    /// then caps the scores).
    pub softcap: Option<f32>,
    /// `Some(sinks)` (`[heads]`, on the queries' device): query head `h`'s softmax has
    /// `sinks[h]` among its logits, unscaled, a key that weighs no value, so that its weights
    /// sum to less than 1: `p_j = exp(s_j - m) / (exp(sinks[h] - m) + Σ_k exp(s_k - m))`
    /// (gpt-oss's attention sinks, as `mx.fast.scaled_dot_product_attention(..., sinks=)`).
    pub sinks: Option<&'a Tensor>,
}

impl<'a> AttentionOptions<'a> {
    /// Plain scaled dot-product attention.
    pub fn scaled(scale: f32) -> Self {
        AttentionOptions {
            scale,
            softcap: None,
            sinks: None,
        }
    }

    /// These with scores soft-capped at `cap`.
    pub fn with_softcap(self, cap: f32) -> Self {
        AttentionOptions {
            softcap: Some(cap),
            ..self
        }
    }

    /// These with one sink logit per query head (`[heads]`).
    pub fn with_sinks(self, sinks: &'a Tensor) -> Self {
        AttentionOptions {
            sinks: Some(sinks),
            ..self
        }
    }

    /// Refuses a cap that is not positive and finite, and sinks that are not one per head.
    fn check(&self, heads: usize) -> Result<()> {
        check(
            self.softcap.is_none_or(|c| c > 0.0 && c.is_finite()),
            || format!("attention soft cap {:?}", self.softcap),
        )?;
        check(self.sinks.is_none_or(|s| s.len() == heads), || {
            format!(
                "attention sinks {:?} for {heads} heads",
                self.sinks.map(|s| s.shape().to_vec())
            )
        })
    }

    /// These as the CPU kernels take them: an error if the sinks are not on the host.
    fn on_host(&self, op: &str) -> Result<cpu::attention::Options<'a>> {
        Ok(cpu::attention::Options {
            scale: self.scale,
            softcap: self.softcap,
            sinks: match self.sinks.map(|s| &s.storage) {
                None => None,
                Some(Storage::Host(s)) => Some(&s[..]),
                Some(Storage::Cuda(_)) => return Err(mismatch(op)),
            },
        })
    }

    /// These as the CUDA kernels take them: an error if the sinks are not on `q`'s GPU.
    fn on_gpu(&self, q: &Buffer, op: &str) -> Result<cuda::attention::Options<'a>> {
        Ok(cuda::attention::Options {
            scale: self.scale,
            softcap: self.softcap,
            sinks: match self.sinks.map(|s| &s.storage) {
                None => None,
                Some(Storage::Cuda(s)) if s.gpu().same(q.gpu()) => Some(s),
                Some(_) => return Err(mismatch(op)),
            },
        })
    }
}

/// Scaled dot-product attention of `q` (`[tokens, heads · head_dim]`) over `kv`: query `t`
/// sees positions up to `positions[t]` (causal) within the window, and query head `h` reads
/// key head `h / (heads / kv_heads)` (grouped-query attention). `options` give the scale, and
/// may soft-cap the scores and add sinks. Returns `[tokens, heads · head_dim]`.
pub fn attention(
    q: &Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    kv: &KvView,
    options: AttentionOptions,
) -> Result<Tensor> {
    check_kv(q, positions.len(), heads, head_dim, kv)?;
    options.check(heads)?;
    let shape = vec![positions.len(), heads * head_dim];
    let p = positions.as_slice();
    match &q.storage {
        Storage::Host(q) => {
            let options = options.on_host("attention")?;
            let mut out = vec![0.0; q.len()];
            host_attention(q, heads, head_dim, p, kv, options, &mut out)?;
            Ok(Tensor::new(shape, out))
        }
        Storage::Cuda(qb) => {
            let ring = kv_ring(qb, kv)?;
            let options = options.on_gpu(qb, "attention")?;
            let out = cuda::attention::attention(
                qb,
                heads,
                head_dim,
                positions.on_gpu()?,
                &ring,
                &options,
            )?;
            Ok(Tensor::on_gpu(shape, out))
        }
    }
}

/// Host caches as the CPU attention kernels read them, all of one precision.
enum HostViews<'a> {
    F32(Vec<cpu::attention::KvView<&'a [f32]>>),
    F16(Vec<cpu::attention::KvView<&'a [half::f16]>>),
    Quant(Vec<cpu::attention::KvView<cpu::attention::QuantRows<'a>>>),
}

impl<'a> HostViews<'a> {
    /// `kvs` as views; an error for `op` where one is not on the host in the first's precision.
    fn of(kvs: &[KvView<'a>], op: &str) -> Result<Self> {
        fn views<'a, R: cpu::attention::KvRows>(
            kvs: &[KvView<'a>],
            op: &str,
            rows: impl Fn(&'a RingStorage) -> Option<R>,
        ) -> Result<Vec<cpu::attention::KvView<R>>> {
            kvs.iter()
                .map(|kv| {
                    Ok(cpu::attention::KvView {
                        keys: rows(&kv.keys.storage).ok_or_else(|| mismatch(op))?,
                        values: rows(&kv.values.storage).ok_or_else(|| mismatch(op))?,
                        kv_heads: kv.kv_heads,
                        capacity: kv.capacity,
                        start: kv.start,
                        end: kv.end,
                        window: kv.window,
                    })
                })
                .collect()
        }
        Ok(match kvs.first().map(|kv| &kv.keys.storage) {
            Some(RingStorage::HostF32(_)) => HostViews::F32(views(kvs, op, |s| match s {
                RingStorage::HostF32(v) => Some(&v[..]),
                _ => None,
            })?),
            Some(RingStorage::HostF16(_)) => HostViews::F16(views(kvs, op, |s| match s {
                RingStorage::HostF16(v) => Some(&v[..]),
                _ => None,
            })?),
            Some(RingStorage::HostQuant(first)) => HostViews::Quant(views(kvs, op, |s| match s {
                RingStorage::HostQuant(v) if v.quant == first.quant => Some(v.rows()),
                _ => None,
            })?),
            _ => return Err(mismatch(op)),
        })
    }
}

/// [`attention`] on the host into `out`, over rings of any host precision.
fn host_attention(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kv: &KvView,
    options: cpu::attention::Options,
    out: &mut [f32],
) -> Result<()> {
    let (h, d, p, o) = (heads, head_dim, positions, options);
    match HostViews::of(std::slice::from_ref(kv), "attention")? {
        HostViews::F32(v) => cpu::attention::attention(q, h, d, p, &v[0], o, out),
        HostViews::F16(v) => cpu::attention::attention(q, h, d, p, &v[0], o, out),
        HostViews::Quant(v) => cpu::attention::attention(q, h, d, p, &v[0], o, out),
    }
    Ok(())
}

/// [`attention_batch`] on the host into `out`: every cache in the first one's precision.
fn host_attention_batch(
    q: &[f32],
    heads: usize,
    head_dim: usize,
    positions: &[usize],
    kvs: &[KvView],
    options: cpu::attention::Options,
    out: &mut [f32],
) -> Result<()> {
    let Some(first) = kvs.first() else {
        return Ok(());
    };
    check(kvs.iter().all(|kv| kv.kv_heads == first.kv_heads), || {
        "a batch's caches differ in heads".into()
    })?;
    let (h, d, p, o) = (heads, head_dim, positions, options);
    match HostViews::of(kvs, "attention_batch")? {
        HostViews::F32(v) => cpu::attention::attention_batch(q, h, d, p, &v, o, out),
        HostViews::F16(v) => cpu::attention::attention_batch(q, h, d, p, &v, o, out),
        HostViews::Quant(v) => cpu::attention::attention_batch(q, h, d, p, &v, o, out),
    }
    Ok(())
}

/// Refuses a cache that `tokens` queries of `q` (`heads` of `head_dim`) cannot attend over.
fn check_kv(q: &Tensor, tokens: usize, heads: usize, head_dim: usize, kv: &KvView) -> Result<()> {
    let row = kv.kv_heads * head_dim;
    check(
        q.len() == tokens * heads * head_dim
            && kv.kv_heads > 0
            && heads.is_multiple_of(kv.kv_heads)
            && kv.keys.len() == kv.capacity * row
            && kv.values.len() == kv.capacity * row
            && kv.start <= kv.end
            && kv.end - kv.start <= kv.capacity,
        || {
            format!(
                "attention of {:?} ({heads} heads of {head_dim}) over {} KV heads × {}",
                q.shape(),
                kv.kv_heads,
                kv.capacity
            )
        },
    )
}

/// `kv` as the CUDA attention kernels read it, when it is on `q`'s GPU.
fn kv_ring<'a>(q: &Buffer, kv: &KvView<'a>) -> Result<cuda::attention::KvView<'a>> {
    match (&kv.keys.storage, &kv.values.storage) {
        (RingStorage::Cuda(k), RingStorage::Cuda(v))
            if q.gpu().same(k.gpu()) && q.gpu().same(v.gpu()) && k.precision() == v.precision() =>
        {
            Ok(cuda::attention::KvView {
                keys: k,
                values: v,
                kv_heads: kv.kv_heads,
                capacity: kv.capacity,
                start: kv.start,
                end: kv.end,
                window: kv.window.unwrap_or(usize::MAX),
            })
        }
        _ => Err(mismatch("attention")),
    }
}

/// [`attention`] of one query token for each of several sequences: row `i` of `q`
/// (`[sequences, heads · head_dim]`) sits at `positions[i]` and attends over `kvs[i]`; one
/// launch on a GPU.
pub fn attention_batch(
    q: &Tensor,
    heads: usize,
    head_dim: usize,
    positions: &Positions,
    kvs: &[KvView],
    options: AttentionOptions,
) -> Result<Tensor> {
    let n = kvs.len();
    check(positions.len() == n, || {
        format!("{} positions for {n} caches", positions.len())
    })?;
    for kv in kvs {
        check_kv(q, n, heads, head_dim, kv)?;
    }
    options.check(heads)?;
    match &q.storage {
        Storage::Host(q) => {
            let options = options.on_host("attention_batch")?;
            let mut out = vec![0.0; q.len()];
            host_attention_batch(
                q,
                heads,
                head_dim,
                positions.as_slice(),
                kvs,
                options,
                &mut out,
            )?;
            Ok(Tensor::new(vec![n, heads * head_dim], out))
        }
        Storage::Cuda(qb) => {
            let rings = kvs
                .iter()
                .map(|kv| kv_ring(qb, kv))
                .collect::<Result<Vec<_>>>()?;
            let options = options.on_gpu(qb, "attention_batch")?;
            let out = cuda::attention::attention_batch(
                qb,
                heads,
                head_dim,
                positions.on_gpu()?,
                &rings,
                &options,
            )?;
            Ok(Tensor::on_gpu(vec![n, heads * head_dim], out))
        }
    }
}
