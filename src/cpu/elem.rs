//! Element types the CPU path reads and writes (f32, f16, bf16; all arithmetic is f32), and
//! the row copies that convert them into dense f32 tiles.

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::problem::{KeyRows, Strides};

/// Element types the CPU path reads and writes; all arithmetic is f32.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// bf16, which the bf16 tile engines read as stored.
    const IS_BF16: bool = false;
    fn to_f32(self) -> f32;
    fn from_f32(x: f32) -> Self;
    /// Converts a contiguous run; overridden where a vectorised conversion exists.
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        for (o, x) in dst.iter_mut().zip(src) {
            *o = x.to_f32();
        }
    }
}

impl Elem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        x
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        // Fixed 16-float chunks inline as vector moves; `copy_from_slice` of a run-time length
        // was a libc call per row, 128 of them per K/V tile.
        let mut o = dst.chunks_exact_mut(16);
        let mut i = src.chunks_exact(16);
        for (o, i) in (&mut o).zip(&mut i) {
            o.copy_from_slice(i);
        }
        o.into_remainder().copy_from_slice(i.remainder());
    }
}

impl Elem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("f16c") {
            // SAFETY: f16c (and with it avx) is available on this CPU.
            return unsafe { f16c_load(dst, src) };
        }
        src.convert_to_f32_slice(dst);
    }
}

/// [`Elem::load_f32`] for f16 with the F16C conversion, 8 elements per instruction in one call
/// (`half`'s slice conversion makes a call per 8 elements).
///
/// # Safety
/// avx and f16c must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16c_load(dst: &mut [f32], src: &[f16]) {
    use std::arch::x86_64::{_mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    let n = dst.len().min(src.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements `i .. i + 8` lie inside both slices.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        i += 8;
    }
    for (o, x) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *o = x.to_f32();
    }
}

impl Elem for bf16 {
    const IS_BF16: bool = true;
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        // A bf16 is the upper half of an f32: a shift, which the compiler vectorises (`half`'s
        // slice conversion is a scalar loop). A NaN keeps its payload, so stays NaN.
        for (o, x) in dst.iter_mut().zip(src) {
            *o = f32::from_bits((x.to_bits() as u32) << 16);
        }
    }
}

/// Every e4m3 value in f32 (exactly), by its bits: an FP8 cache converts at one table read per
/// element.
const E4M3_F32: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = float8::F8E4M3::to_f32(&float8::F8E4M3::from_bits(i as u8));
        i += 1;
    }
    t
};

impl Elem for float8::F8E4M3 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        E4M3_F32[self.to_bits() as usize]
    }
    #[inline(always)]
    fn from_f32(x: f32) -> Self {
        float8::F8E4M3::from_f32(x)
    }
    #[inline(always)]
    fn load_f32(dst: &mut [f32], src: &[Self]) {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: avx2 and f16c (and with them avx) are available on this CPU.
            return unsafe { e4m3_load(dst, src) };
        }
        for (o, x) in dst.iter_mut().zip(src) {
            *o = E4M3_F32[x.to_bits() as usize];
        }
    }
}

/// The eight e4m3 bytes in the low half of `x` as f32, exactly: the magnitude bits moved into
/// an f16's exponent and mantissa (e4m3's exponent bias 7 against f16's 15: the f16 is the value
/// times 2^-8, subnormals included), converted by F16C and scaled by 2^8, both exact; the two
/// NaN codes (all magnitude bits set) become NaN. Shared by [`Elem::load_f32`] and the AVX2
/// decode kernels, which read FP8 rows in place.
#[cfg(target_arch = "x86_64")]
#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(super) fn e4m3x8(x: std::arch::x86_64::__m128i) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let w = _mm_cvtepu8_epi16(x);
    let mag = _mm_and_si128(w, _mm_set1_epi16(0x7f));
    let h = _mm_or_si128(
        _mm_slli_epi16::<7>(mag),
        _mm_slli_epi16::<8>(_mm_and_si128(w, _mm_set1_epi16(0x80))),
    );
    let f = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.0));
    let nan = _mm256_cvtepi16_epi32(_mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f)));
    _mm256_blendv_ps(f, _mm256_set1_ps(f32::NAN), _mm256_castsi256_ps(nan))
}

/// [`Elem::load_f32`] for e4m3, 8 elements per step ([`e4m3x8`]).
///
/// # Safety
/// avx2 and f16c must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,f16c")]
unsafe fn e4m3_load(dst: &mut [f32], src: &[float8::F8E4M3]) {
    use std::arch::x86_64::*;
    let n = dst.len().min(src.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements `i .. i + 8` lie inside both slices (F8E4M3 is one byte).
        unsafe {
            let x = _mm_loadl_epi64(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), e4m3x8(x));
        }
        i += 8;
    }
    for (o, x) in dst[i..n].iter_mut().zip(&src[i..n]) {
        *o = E4M3_F32[x.to_bits() as usize];
    }
}

/// Copies `rows` rows of one head, starting at `row0`, into a dense f32 `rows × d` block.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_rows<T: Elem>(
    dst: &mut [f32],
    src: &[T],
    s: &Strides,
    b: usize,
    row0: usize,
    rows: usize,
    head: usize,
    d: usize,
) {
    for (r, dst) in dst[..rows * d].chunks_exact_mut(d).enumerate() {
        let base = s.at(b, row0 + r, head);
        if s.dim == 1 {
            T::load_f32(dst, &src[base..base + d]);
        } else {
            for (x, o) in dst.iter_mut().enumerate() {
                *o = src[base + x * s.dim].to_f32();
            }
        }
    }
}

/// Copies keys `j0 .. j0 + n` of one head, addressed through `keys`, into a dense f32 `n × d`
/// block: one [`load_rows`] per run of consecutive rows (the whole tile when dense, each page's
/// part when paged).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn load_keys<T: Elem>(
    dst: &mut [f32],
    src: &[T],
    s: &Strides,
    keys: &KeyRows,
    j0: usize,
    n: usize,
    head: usize,
    d: usize,
) {
    let mut c = 0;
    while c < n {
        let run = keys.run(j0 + c, n - c);
        let (b, row) = keys.at(j0 + c);
        load_rows(&mut dst[c * d..], src, s, b, row, run, head, d);
        c += run;
    }
}

/// `v` as a `Vec<B>` when `A` and `B` are the same type (no copy), else `v` back.
pub(super) fn same_vec<A: 'static, B: 'static>(v: Vec<A>) -> Result<Vec<B>, Vec<A>> {
    let mut slot = Some(v);
    match (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<Vec<B>>>() {
        Some(same) => Ok(same.take().unwrap_or_default()),
        None => Err(slot.unwrap_or_default()),
    }
}

/// `s` as a `&[B]` when `A` and `B` are the same type, else `None`.
pub(super) fn same_slice<A: 'static, B: 'static>(s: &[A]) -> Option<&[B]> {
    use std::any::TypeId;
    (TypeId::of::<A>() == TypeId::of::<B>()).then(|| {
        // SAFETY: A and B are the same type, so this is `s` itself.
        unsafe { std::slice::from_raw_parts(s.as_ptr().cast::<B>(), s.len()) }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every e4m3 code converts as `float8` converts it, bit for bit (NaN as NaN), through the
    /// table and through the vector path where the CPU has it, at every position of a block.
    #[test]
    fn e4m3_converts_exactly() {
        let codes: Vec<float8::F8E4M3> = (0..=255u8)
            .chain(0..=255u8)
            .map(float8::F8E4M3::from_bits)
            .collect();
        for start in 0..9 {
            let src = &codes[start..start + 300];
            let mut dst = vec![0f32; src.len()];
            float8::F8E4M3::load_f32(&mut dst, src);
            for (x, &got) in src.iter().zip(&dst) {
                let want = x.to_f32();
                let same = got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan());
                assert!(same, "e4m3 {:#04x}: {got} against {want}", x.to_bits());
                let table = <float8::F8E4M3 as Elem>::to_f32(*x);
                assert!(table.to_bits() == want.to_bits() || (table.is_nan() && want.is_nan()));
            }
        }
    }
}
