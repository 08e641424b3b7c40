//! `mlx.optimizers.Adam` as mlx-lm's LoRA trainer uses it: betas (0.9, 0.999), eps 1e-8 and no
//! bias correction, in f32 with MLX's order of operations.

use std::collections::BTreeMap;

use oxlm_models::lora::Adapters;
use oxlm_models::lora_grad::{AdapterGrads, LoraGrad};

pub struct Adam {
    pub learning_rate: f32,
    b1: f32,
    b2: f32,
    /// `1 - b1` and `1 - b2` as MLX gets them: computed in f64 by Python, then made f32.
    c1: f32,
    c2: f32,
    eps: f32,
    /// First and second moments, shaped as the gradients, by layer (`path`, or `path[e]` for
    /// expert `e` of a stack).
    state: BTreeMap<String, (LoraGrad, LoraGrad)>,
}

impl Adam {
    pub fn new(learning_rate: f32) -> Self {
        let (b1, b2) = (0.9f64, 0.999f64);
        Adam {
            learning_rate,
            b1: b1 as f32,
            b2: b2 as f32,
            c1: (1.0 - b1) as f32,
            c2: (1.0 - b2) as f32,
            eps: 1e-8,
            state: BTreeMap::new(),
        }
    }

    fn step(&self, w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        for i in 0..w.len() {
            m[i] = self.b1 * m[i] + self.c1 * g[i];
            v[i] = self.b2 * v[i] + self.c2 * (g[i] * g[i]);
            w[i] -= self.learning_rate * m[i] / (v[i].sqrt() + self.eps);
        }
    }

    /// One update of every adapter matrix from its gradient.
    pub fn update(&mut self, adapters: &mut Adapters, grads: &AdapterGrads) {
        let plain =
            (adapters.layers.iter_mut()).map(|(path, l)| (path.clone(), l, grads.layers.get(path)));
        let experts = adapters.experts.iter_mut().flat_map(|(path, each)| {
            let g = grads.experts.get(path);
            (each.iter_mut().enumerate())
                .map(move |(e, l)| (format!("{path}[{e}]"), l, g.and_then(|g| g.get(e))))
        });
        for (name, layer, g) in plain.chain(experts) {
            let Some(g) = g else { continue };
            let mut state = (self.state.remove(&name))
                .unwrap_or_else(|| (LoraGrad::zeros(layer), LoraGrad::zeros(layer)));
            let (m, v) = &mut state;
            self.step(&mut layer.a, &g.a, &mut m.a, &mut v.a);
            self.step(&mut layer.b, &g.b, &mut m.b, &mut v.b);
            self.state.insert(name, state);
        }
    }
}
