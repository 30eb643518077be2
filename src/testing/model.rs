//! The single-rank reference of the layer harness: deterministic weights and
//! inputs of a case, and the whole layer for one token in f64.

use super::SplitMix;
use crate::{with_dtype, DType, Element};

/// What the model of a case depends on.
pub(super) struct Spec<'a> {
    pub(super) hidden: usize,
    pub(super) experts: usize,
    pub(super) top_k: usize,
    pub(super) seed: u64,
    pub(super) dtype: DType,
    /// Tokens per DP rank.
    pub(super) dp_tokens: &'a [usize],
    /// Whether the routed transform follows the routed experts.
    pub(super) routed_transform: bool,
    /// Whether there is a shared expert.
    pub(super) shared: bool,
}

/// Intermediate size of the shared expert (divisible by every TP size tested).
pub(super) const SHARED_INTER: usize = 4;

/// Deterministic weights and inputs of a case.
pub(super) struct Model {
    pub(super) h: usize,
    pub(super) e: usize,
    pub(super) k: usize,
    routed_transform: bool,
    shared: bool,
    pub(super) gate: Vec<f32>,
    pub(super) experts: Vec<f32>,
    pub(super) w1: Vec<f32>,
    pub(super) w2: Vec<f32>,
    /// Per DP rank, `[T_d, H]`, already rounded to the case dtype.
    pub(super) inputs: Vec<Vec<f32>>,
}

fn round_to(dtype: DType, v: f32) -> f32 {
    with_dtype!(dtype, T => T::from_f32(v).to_f32())
}

impl Model {
    pub(super) fn new(c: &Spec<'_>) -> Self {
        let (h, e) = (c.hidden, c.experts);
        let mut r = SplitMix::new(c.seed);
        let ws = 1.5 / (h as f32).sqrt();
        let gate = r.vec(e * h, 1.0);
        let experts = r.vec(e * h * h, ws);
        let w1 = r.vec(SHARED_INTER * h, ws);
        let w2 = r.vec(h * SHARED_INTER, 0.8);
        let inputs = c
            .dp_tokens
            .iter()
            .map(|&t| r.vec(t * h, 1.0).into_iter().map(|v| round_to(c.dtype, v)).collect())
            .collect();
        Model {
            h,
            e,
            k: c.top_k,
            routed_transform: c.routed_transform,
            shared: c.shared,
            gate,
            experts,
            w1,
            w2,
            inputs,
        }
    }

    /// Top-k experts (descending logit, lower index on ties) and their softmax weights.
    pub(super) fn route(&self, x: &[f32]) -> (Vec<i32>, Vec<f32>) {
        let logits: Vec<f32> = (0..self.e)
            .map(|e| self.gate[e * self.h..(e + 1) * self.h].iter().zip(x).map(|(g, v)| g * v).sum())
            .collect();
        let mut order: Vec<usize> = (0..self.e).collect();
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        let top = &order[..self.k];
        let m = logits[top[0]];
        let ex: Vec<f32> = top.iter().map(|&i| (logits[i] - m).exp()).collect();
        let sum: f32 = ex.iter().sum();
        (top.iter().map(|&i| i as i32).collect(), ex.iter().map(|v| v / sum).collect())
    }

    pub(super) fn expert(&self, e: usize, x: &[f32]) -> Vec<f32> {
        let w = &self.experts[e * self.h * self.h..(e + 1) * self.h * self.h];
        (0..self.h)
            .map(|o| w[o * self.h..(o + 1) * self.h].iter().zip(x).map(|(a, b)| a * b).sum::<f32>().tanh())
            .collect()
    }

    /// Shared expert restricted to intermediate rows `[lo, hi)`.
    pub(super) fn shared(&self, x: &[f32], lo: usize, hi: usize) -> Vec<f32> {
        let mid = self.shared_mid(x, lo, hi);
        (0..self.h).map(|o| (lo..hi).map(|i| self.w2[o * SHARED_INTER + i] * mid[i - lo]).sum()).collect()
    }

    /// The shared expert's intermediate rows `[lo, hi)`.
    fn shared_mid(&self, x: &[f32], lo: usize, hi: usize) -> Vec<f32> {
        let h = self.h;
        (lo..hi).map(|i| self.w1[i * h..(i + 1) * h].iter().zip(x).map(|(a, b)| a * b).sum::<f32>().tanh()).collect()
    }

    /// The whole layer for one token, in f64 where it sums, and each output
    /// element's rounding magnitude for [`Rounding::tol`]: the routed
    /// terms' magnitudes (times 1.5, the transform's largest slope, plus
    /// the transformed value when it follows) plus the shared expert's terms'.
    ///
    /// [`Rounding::tol`]: super::Rounding::tol
    pub(super) fn reference(&self, x: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let (ids, w) = self.route(x);
        let mut routed = vec![0f64; self.h];
        let mut mag = vec![0f64; self.h];
        for (e, wk) in ids.iter().zip(&w) {
            for ((r, m), y) in routed.iter_mut().zip(mag.iter_mut()).zip(self.expert(*e as usize, x)) {
                *r += *wk as f64 * y as f64;
                *m += (*wk as f64 * y as f64).abs();
            }
        }
        if self.routed_transform {
            for (r, m) in routed.iter_mut().zip(mag.iter_mut()) {
                *r = transform(*r as f32) as f64;
                *m = 1.5 * *m + r.abs();
            }
        }
        if self.shared {
            let mid = self.shared_mid(x, 0, SHARED_INTER);
            for (o, (r, m)) in routed.iter_mut().zip(mag.iter_mut()).enumerate() {
                for (i, v) in mid.iter().enumerate() {
                    let term = self.w2[o * SHARED_INTER + i] as f64 * *v as f64;
                    *r += term;
                    *m += term.abs();
                }
            }
        }
        (routed, mag)
    }
}

pub(super) fn transform(v: f32) -> f32 {
    0.5 * v + v.tanh()
}
