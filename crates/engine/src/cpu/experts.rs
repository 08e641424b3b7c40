//! A mixture of experts' routing on the host: each token's top-k experts and their weights.

use crate::cpu::elementwise::{sigmoid, softmax_inplace};
use crate::params::{ExpertChoice, ExpertGroups, Scoring};

/// Turns each token's router logits (`[n, experts]`) into scores (softmax or sigmoid), in place,
/// and returns its `top_k` experts, best first (ties to the lower expert), with their weights:
/// `[n, top_k]`. The `correction` bias joins the scores that choose, not the weights.
pub fn choose(
    choice: &ExpertChoice,
    correction: Option<&[f32]>,
    scores: &mut [f32],
) -> Vec<(usize, f32)> {
    let count = choice.experts;
    let top_k = choice.top_k;
    let renormalize = choice.renormalizes();
    let mut chosen = Vec::with_capacity(scores.len() / count * top_k);
    let mut order: Vec<usize> = Vec::with_capacity(count);
    let mut picking = vec![0.0f32; count];
    for p in scores.chunks_exact_mut(count) {
        match choice.scoring {
            Scoring::Softmax => softmax_inplace(p),
            Scoring::Sigmoid => p.iter_mut().for_each(|v| *v = sigmoid(*v)),
        }
        picking.copy_from_slice(p);
        if let Some(bias) = correction {
            picking.iter_mut().zip(bias).for_each(|(v, b)| *v += b);
        }
        if let Some(groups) = choice.groups {
            keep_best_groups(groups, &mut picking);
        }
        order.clear();
        order.extend(0..count);
        order.sort_by(|&a, &b| picking[b].total_cmp(&picking[a]).then(a.cmp(&b)));
        let top = &order[..top_k];
        let total: f32 = top.iter().map(|&e| p[e]).sum();
        chosen.extend(top.iter().map(|&e| {
            let weight = if renormalize { p[e] / total } else { p[e] };
            (e, weight * choice.scale)
        }));
    }
    chosen
}

/// As mlx-lm does, the scores of the groups that are not kept become 0 (not -∞: an expert of a
/// dropped group can still beat one whose corrected score is negative).
fn keep_best_groups(groups: ExpertGroups, scores: &mut [f32]) {
    let size = scores.len() / groups.count;
    let best_two = |g: &[f32]| {
        let (mut first, mut second) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
        for &v in g {
            if v > first {
                (first, second) = (v, first);
            } else if v > second {
                second = v;
            }
        }
        first + second
    };
    let group_scores: Vec<f32> = scores.chunks_exact(size).map(best_two).collect();
    let mut order: Vec<usize> = (0..groups.count).collect();
    order.sort_by(|&a, &b| group_scores[a].total_cmp(&group_scores[b]).then(a.cmp(&b)));
    for &g in &order[..groups.count - groups.keep] {
        scores[g * size..][..size].fill(0.0);
    }
}
