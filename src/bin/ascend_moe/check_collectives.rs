//! `check` section `collectives`: every collective x dtype x a few sizes
//! (0, 1, odd, not divisible by the world size, larger than one staging round)
//! against a naive reference computed here, on every rank.
//!
//! Every rank computes its own reference, and an all-gather's output holds
//! the whole world's data, so the largest size shrinks as the world grows
//! past 4 ranks ([`largest`]): memory and time then grow linearly with the
//! world, not with its square (64 thread ranks at the 4-rank size would need
//! some 90 GiB).

use ascend_moe::half::{bf16, f16};
use ascend_moe::testing::mix;
use ascend_moe::{with_dtype, with_reducible_dtype, Collectives, Comm, DType, Element, ReduceOp, Tensor};

use crate::check::Row;

/// The sizes of a world of `world` ranks: 0, 1, 1001 and [`largest`].
fn sizes(world: usize) -> [usize; 4] {
    [0, 1, 1001, largest(world)]
}

/// The largest size: 700,001 elements up to 4 ranks (more than one 1 MiB
/// staging round for every dtype wider than a byte); beyond, 2.8 M elements
/// in total over the world, so a rank's references and gathered output stay
/// at the 4-rank size. Never divisible by the world size.
fn largest(world: usize) -> usize {
    let n = if world <= 4 { 700_001 } else { 2_800_000 / world + 1 };
    if world > 1 && n % world == 0 {
        n - 1
    } else {
        n
    }
}

/// Element types with a reference reduction.
trait Ref: Element {
    fn gen(seed: u64, rank: usize, i: usize) -> Self;
    fn fold(op: ReduceOp, xs: &[Self]) -> Self;
}

fn hash(seed: u64, rank: usize, i: usize) -> u64 {
    mix(seed ^ mix((rank as u64) << 40 ^ i as u64))
}

/// Values in [-4, 4) x 2^-12..=2^11, so f32 sums depend on the summation order.
fn uniform(seed: u64, rank: usize, i: usize) -> f32 {
    let h = hash(seed, rank, i);
    ((h >> 40) as f32 / (1u32 << 24) as f32 * 8.0 - 4.0) * f32::powi(2.0, (h % 24) as i32 - 12)
}

fn fold_f32(op: ReduceOp, xs: impl Iterator<Item = f32>) -> f32 {
    xs.reduce(|a, x| match op {
        ReduceOp::Sum => a + x,
        ReduceOp::Max => a.max(x),
        ReduceOp::Min => a.min(x),
    })
    .unwrap_or(0.0)
}

macro_rules! float_ref {
    ($t:ty) => {
        impl Ref for $t {
            fn gen(seed: u64, rank: usize, i: usize) -> Self {
                <$t as Element>::from_f32(uniform(seed, rank, i))
            }
            fn fold(op: ReduceOp, xs: &[Self]) -> Self {
                <$t as Element>::from_f32(fold_f32(op, xs.iter().map(|x| Element::to_f32(*x))))
            }
        }
    };
}
float_ref!(f32);
float_ref!(f16);
float_ref!(bf16);

macro_rules! int_ref {
    ($t:ty) => {
        impl Ref for $t {
            fn gen(seed: u64, rank: usize, i: usize) -> Self {
                hash(seed, rank, i) as $t
            }
            fn fold(op: ReduceOp, xs: &[Self]) -> Self {
                xs.iter()
                    .copied()
                    .reduce(|a, x| match op {
                        ReduceOp::Sum => a.wrapping_add(x),
                        ReduceOp::Max => a.max(x),
                        ReduceOp::Min => a.min(x),
                    })
                    .unwrap_or(0)
            }
        }
    };
}
int_ref!(i32);
int_ref!(i64);

fn data<T: Ref>(seed: u64, rank: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| T::gen(seed, rank, i)).collect()
}

/// Elements `range` of the reduction over the world, rank 0 first; the
/// ranks' data is generated element by element, never held whole.
fn reduced<T: Ref>(seed: u64, world: usize, range: std::ops::Range<usize>, op: ReduceOp) -> Vec<T> {
    let mut xs = Vec::with_capacity(world);
    range
        .map(|i| {
            xs.clear();
            xs.extend((0..world).map(|r| T::gen(seed, r, i)));
            T::fold(op, &xs)
        })
        .collect()
}

fn prefix(c: &[usize]) -> Vec<usize> {
    c.iter()
        .scan(0, |a, &x| {
            let d = *a;
            *a += x;
            Some(d)
        })
        .collect()
}

fn tensor<T: Element>(v: &[T]) -> ascend_moe::Result<Tensor> {
    Tensor::from_slice(v, &[v.len()])
}

/// Compares bitwise; returns the row.
fn row<T: Element>(case: String, n: usize, got: &Tensor, want: &[T]) -> Row {
    let detail = match got.as_slice::<T>() {
        Err(e) => e.to_string(),
        Ok(g) if g.len() != want.len() => format!("got {} elements, want {}", g.len(), want.len()),
        Ok(g) => {
            let wrong = g.iter().zip(want).filter(|(a, b)| bytemuck::bytes_of(*a) != bytemuck::bytes_of(*b)).count();
            match g.iter().zip(want).position(|(a, b)| bytemuck::bytes_of(a) != bytemuck::bytes_of(b)) {
                None => String::new(),
                Some(i) => format!("{wrong} wrong, first at {i}: got {:?}, want {:?}", g[i], want[i]),
            }
        }
    };
    Row { section: "collectives", case, dtype: T::DTYPE.name().into(), count: n, ok: detail.is_empty(), detail }
}

fn cases<T: Ref>(comm: &Comm, rows: &mut Vec<Row>) -> ascend_moe::Result<()> {
    let (rank, w) = (comm.rank(), comm.world_size());
    let dt = T::DTYPE;
    for (si, n) in sizes(w).into_iter().enumerate() {
        let seed = (dt as u64) << 32 | (si as u64) << 16;
        for op in ReduceOp::ALL {
            let s = seed + op as u64;
            let src = tensor(&data::<T>(s, rank, n))?;
            let mut dst = Tensor::zeros_cpu(&[n], dt);
            comm.all_reduce(&src, &mut dst, op)?;
            rows.push(row(format!("all_reduce {}", op.name()), n, &dst, &reduced::<T>(s, w, 0..n, op)));
        }
        let s = seed + 4;
        let mut buf = tensor(&data::<T>(s, rank, n))?;
        comm.all_reduce_in_place(&mut buf, ReduceOp::Sum)?;
        rows.push(row("all_reduce sum in place".into(), n, &buf, &reduced::<T>(s, w, 0..n, ReduceOp::Sum)));
        // reduce_scatter: n elements in total, n / w per rank (rounded down).
        let s = seed + 5;
        let per = n / w;
        let src = tensor(&data::<T>(s, rank, per * w))?;
        let mut dst = Tensor::zeros_cpu(&[per], dt);
        comm.reduce_scatter(&src, &mut dst, ReduceOp::Sum)?;
        let want = reduced::<T>(s, w, rank * per..(rank + 1) * per, ReduceOp::Sum);
        rows.push(row("reduce_scatter sum".into(), per * w, &dst, &want));
        // The V variants: uneven counts that do not divide by the world size.
        let counts: Vec<usize> = (0..w).map(|j| (n / w + j * (n % 7)) % (n + 1)).collect();
        let (total, d) = (counts.iter().sum::<usize>(), prefix(&counts));
        let s = seed + 6;
        let src = tensor(&data::<T>(s, rank, total))?;
        let mut dst = Tensor::zeros_cpu(&[counts[rank]], dt);
        comm.reduce_scatter_v(&src, &mut dst, &counts, ReduceOp::Max)?;
        let want = reduced::<T>(s, w, d[rank]..d[rank] + counts[rank], ReduceOp::Max);
        rows.push(row("reduce_scatter_v max".into(), total, &dst, &want));
        move_cases(comm, rows, si, n, seed, T::gen)?;
    }
    comm.barrier()
}

fn gen_data<T: Element>(gen: fn(u64, usize, usize) -> T, seed: u64, rank: usize, n: usize) -> Vec<T> {
    (0..n).map(|i| gen(seed, rank, i)).collect()
}

/// The data-movement collectives (bitwise exact for every dtype) on size
/// index `si` (`n` elements), data from `gen`.
fn move_cases<T: Element>(
    comm: &Comm,
    rows: &mut Vec<Row>,
    si: usize,
    n: usize,
    seed: u64,
    gen: fn(u64, usize, usize) -> T,
) -> ascend_moe::Result<()> {
    let (rank, w) = (comm.rank(), comm.world_size());
    let dt = T::DTYPE;
    let counts: Vec<usize> = (0..w).map(|j| (n / w + j * (n % 7)) % (n + 1)).collect();
    let total = counts.iter().sum::<usize>();
    let s = seed + 7;
    let src = tensor(&gen_data(gen, s, rank, n))?;
    let mut dst = Tensor::zeros_cpu(&[n * w], dt);
    comm.all_gather(&src, &mut dst)?;
    let want: Vec<T> = (0..w).flat_map(|j| gen_data(gen, s, j, n)).collect();
    rows.push(row("all_gather".into(), n * w, &dst, &want));
    let s = seed + 8;
    let src = tensor(&gen_data(gen, s, rank, counts[rank]))?;
    let mut dst = Tensor::zeros_cpu(&[total], dt);
    comm.all_gather_v(&src, &mut dst, &counts)?;
    let want: Vec<T> = (0..w).flat_map(|j| gen_data(gen, s, j, counts[j])).collect();
    rows.push(row("all_gather_v".into(), total, &dst, &want));
    // all_to_all_v: m[i][j] elements from rank i to rank j.
    let m: Vec<Vec<usize>> = (0..w).map(|i| (0..w).map(|j| (n / w + i * 3 + j) % (n + 1)).collect()).collect();
    let s = seed + 9;
    let send = m[rank].clone();
    let recv: Vec<usize> = (0..w).map(|i| m[i][rank]).collect();
    let src = tensor(&gen_data(gen, s, rank, send.iter().sum()))?;
    let mut dst = Tensor::zeros_cpu(&[recv.iter().sum()], dt);
    comm.all_to_all_v(&src, &send, &mut dst, &recv)?;
    let want: Vec<T> = (0..w)
        .flat_map(|i| {
            let from = gen_data(gen, s, i, m[i].iter().sum());
            let off = prefix(&m[i])[rank];
            from[off..off + m[i][rank]].to_vec()
        })
        .collect();
    rows.push(row("all_to_all_v".into(), recv.iter().sum(), &dst, &want));
    let s = seed + 10;
    let root = (si + 1) % w;
    let mut buf = tensor(&gen_data(gen, s, rank, n))?;
    comm.broadcast(&mut buf, root)?;
    rows.push(row(format!("broadcast root {root}"), n, &buf, &gen_data(gen, s, root, n)));
    Ok(())
}

/// Any byte of a one-byte dtype (every bit pattern, NaN codes included).
fn byte_gen<T: Element>(seed: u64, rank: usize, i: usize) -> T {
    bytemuck::cast::<u8, T>(hash(seed, rank, i) as u8)
}

/// The one-byte dtypes: moved bitwise, and a reduction refused on every rank.
fn byte_cases<T: Element>(comm: &Comm, rows: &mut Vec<Row>) -> ascend_moe::Result<()> {
    let dt = T::DTYPE;
    for (si, n) in sizes(comm.world_size()).into_iter().enumerate() {
        move_cases(comm, rows, si, n, (dt as u64) << 32 | (si as u64) << 16, byte_gen::<T>)?;
    }
    let src = tensor(&gen_data(byte_gen::<T>, 1, comm.rank(), 8))?;
    let mut dst = Tensor::zeros_cpu(&[8], dt);
    let detail = match comm.all_reduce(&src, &mut dst, ReduceOp::Sum) {
        Ok(()) => format!("all_reduce of {dt} was accepted"),
        Err(e) if e.to_string().contains("never reduced") => String::new(),
        Err(e) => format!("unexpected error: {e}"),
    };
    rows.push(Row {
        section: "collectives",
        case: "all_reduce refused".into(),
        dtype: dt.name().into(),
        count: 8,
        ok: detail.is_empty(),
        detail,
    });
    comm.barrier()
}

/// Runs the section on one rank.
pub fn run(comm: &Comm) -> ascend_moe::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for dt in DType::REDUCIBLE {
        with_reducible_dtype!(dt, T => cases::<T>(comm, &mut rows)?, else ());
    }
    for dt in DType::BYTE_MOVES {
        with_dtype!(dt, T => byte_cases::<T>(comm, &mut rows)?);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::largest;

    #[test]
    fn the_largest_size_is_never_divisible_and_bounds_the_gathered_output() {
        for w in 1..=64 {
            let n = largest(w);
            assert!(w == 1 || n % w != 0, "{n} elements divide among {w} ranks");
            if w <= 4 {
                assert_eq!(n, 700_001, "world {w}");
            } else {
                // What one rank gathers (and its reference) stays at the 4-rank size.
                assert!(n * w <= 4 * 700_001 + w, "world {w}: {n} x {w} elements gathered");
                assert!(n > 1001, "world {w}: the largest size {n} is not the largest");
            }
        }
    }
}
