//! Zigzag sharding of a sequence over the ranks of a ring, which balances causal attention.
//!
//! A sequence of `S` positions over `W` ranks is cut into `2W` chunks of `c = S / (2W)`
//! positions; rank `r` holds chunks `r` and `2W - 1 - r`, in that order. So global position
//! `p`, in chunk `j = p / c`, lives on rank `j` if `j < W` else `2W - 1 - j`, at local row
//! `p % c` (first chunk) or `c + p % c` (second chunk). Under a causal mask each rank then has
//! the same work: one early chunk that sees few keys and one late chunk that sees many.
//!
//! ```
//! use candle_flash::ring::{zigzag_global, zigzag_local};
//!
//! // 16 positions over 2 ranks: chunks of 4; rank 0 holds 0..4 and 12..16, rank 1 holds 4..12.
//! assert_eq!(zigzag_local(13, 16, 2)?, (0, 5));
//! assert_eq!(zigzag_global(1, 6, 16, 2)?, 10);
//! # Ok::<(), candle::Error>(())
//! ```

use candle::{bail, Result, Tensor};

/// `c`, the chunk length, after checking that `seq` splits into `2 · world` equal chunks.
fn chunk(seq: usize, world: usize) -> Result<usize> {
    if world == 0 || !seq.is_multiple_of(2 * world) {
        bail!(
            "zigzag: a sequence of {seq} positions does not split into 2 x {world} (world size) \
             equal chunks"
        )
    }
    Ok(seq / (2 * world))
}

/// `(rank, local row)` of global position `p` in a zigzag-sharded sequence of `seq` positions
/// over `world` ranks.
///
/// # Errors
///
/// When `seq` is not a multiple of `2 · world` or `p >= seq`.
pub fn zigzag_local(p: usize, seq: usize, world: usize) -> Result<(usize, usize)> {
    let c = chunk(seq, world)?;
    if p >= seq {
        bail!("zigzag: position {p} is outside a sequence of {seq}")
    }
    let j = p / c;
    Ok(match j < world {
        true => (j, p % c),
        false => (2 * world - 1 - j, c + p % c),
    })
}

/// The global position of local row `row` of rank `rank` (the inverse of [`zigzag_local`]).
///
/// # Errors
///
/// When `seq` is not a multiple of `2 · world`, `rank >= world` or `row >= 2 · seq / (2 world)`.
pub fn zigzag_global(rank: usize, row: usize, seq: usize, world: usize) -> Result<usize> {
    let c = chunk(seq, world)?;
    if rank >= world || row >= 2 * c {
        bail!(
            "zigzag: rank {rank} row {row} is outside {world} ranks of {} rows",
            2 * c
        )
    }
    Ok(match row < c {
        true => rank * c + row,
        false => (2 * world - 1 - rank) * c + row - c,
    })
}

/// Rank `rank`'s zigzag shard of `x` along dimension `dim` (the sequence dimension: 1 for
/// `(batch, seq, heads, head_dim)`): chunks `rank` and `2 · world - 1 - rank` of `2 · world`,
/// concatenated (contiguous).
///
/// # Errors
///
/// When `rank >= world`, `dim` is out of range, or the dimension does not split into `2 · world`
/// equal chunks.
pub fn zigzag_shard(x: &Tensor, dim: usize, rank: usize, world: usize) -> Result<Tensor> {
    if dim >= x.rank() {
        bail!(
            "zigzag_shard: dim {dim} is out of range for x of shape {:?}",
            x.dims()
        )
    }
    let c = chunk(x.dim(dim)?, world)?;
    if rank >= world {
        bail!("zigzag_shard: rank {rank} is not below the world size {world}")
    }
    Tensor::cat(
        &[
            x.narrow(dim, rank * c, c)?,
            x.narrow(dim, (2 * world - 1 - rank) * c, c)?,
        ],
        dim,
    )
}

/// The whole sequence from the shards of every rank (in rank order) along dimension `dim`:
/// the inverse of [`zigzag_shard`].
///
/// # Errors
///
/// When there is no shard, the shards differ in shape, `dim` is out of range or a shard's
/// length along it is odd.
pub fn zigzag_unshard(shards: &[Tensor], dim: usize) -> Result<Tensor> {
    let Some(first) = shards.first() else {
        bail!("zigzag_unshard: no shard")
    };
    if dim >= first.rank() {
        bail!(
            "zigzag_unshard: dim {dim} is out of range for shards of shape {:?}",
            first.dims()
        )
    }
    if let Some(s) = shards.iter().find(|s| s.dims() != first.dims()) {
        bail!(
            "zigzag_unshard: shards must share one shape, got {:?} and {:?}",
            first.dims(),
            s.dims()
        )
    }
    let two_c = first.dim(dim)?;
    if !two_c.is_multiple_of(2) {
        bail!("zigzag_unshard: a shard of {two_c} rows is not two equal chunks")
    }
    let c = two_c / 2;
    let early = shards.iter().map(|s| s.narrow(dim, 0, c));
    let late = shards.iter().rev().map(|s| s.narrow(dim, c, c));
    let chunks = early.chain(late).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&chunks, dim)
}
