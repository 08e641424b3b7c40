//! The kernels' thread pool: persistent workers that sleep on a condition variable between jobs
//! and never spin, because spinning workers on hyperthreads of one core (a common 2-vCPU cloud
//! machine), or on cores other programs also use, take the core from the thread doing the work.
//! One thread per physical core by default ([`default_threads`]).
//!
//! A job is a number of tasks claimed from a shared counter by the caller and the workers
//! alike; the caller returns once every task has run. Jobs do not nest: a job started while
//! another runs (from a task, or from a second caller thread) runs on its caller alone.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

/// One job as the workers see it: `f` and `next` live on the caller's stack, which
/// [`parallel_for`] does not leave until every worker has let go of them.
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    next: *const AtomicUsize,
}

// SAFETY: the pointers are only dereferenced while `parallel_for` keeps their targets alive,
// and the targets are `Sync`.
unsafe impl Send for Job {}

struct State {
    generation: u64,
    job: Option<Job>,
    /// Workers that have not yet finished the current job.
    busy: usize,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
}

struct Pool {
    threads: usize,
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

impl Pool {
    fn new(threads: usize) -> Pool {
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                generation: 0,
                job: None,
                busy: 0,
                stop: false,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
        });
        let workers = (1..threads)
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("oxlm-worker-{i}"))
                    .spawn(move || worker(&shared))
                    .expect("spawning a kernel worker thread")
            })
            .collect();
        Pool {
            threads,
            shared,
            workers,
        }
    }

    fn shut_down(self) {
        self.shared.state.lock().unwrap().stop = true;
        self.shared.wake.notify_all();
        for w in self.workers {
            let _ = w.join();
        }
    }
}

fn run_tasks(job: Job) {
    // SAFETY: see `Job`.
    let (f, next) = unsafe { (&*job.f, &*job.next) };
    loop {
        let i = next.fetch_add(1, Ordering::Relaxed);
        if i >= job.tasks {
            break;
        }
        f(i);
    }
}

fn worker(shared: &Shared) {
    let mut seen = 0;
    loop {
        let job = {
            let mut s = shared.state.lock().unwrap();
            while s.generation == seen && !s.stop {
                s = shared.wake.wait(s).unwrap();
            }
            if s.stop {
                return;
            }
            seen = s.generation;
            s.job
        };
        if let Some(job) = job {
            run_tasks(job);
        }
        let mut s = shared.state.lock().unwrap();
        s.busy -= 1;
        if s.busy == 0 {
            shared.done.notify_one();
        }
    }
}

/// The pool; the mutex also makes jobs one at a time.
fn pool() -> &'static Mutex<Pool> {
    static POOL: OnceLock<Mutex<Pool>> = OnceLock::new();
    POOL.get_or_init(|| Mutex::new(Pool::new(default_threads())))
}

/// The thread count a pool starts with: one per physical core the process may run on, as Linux
/// reports the topology, else the CPUs the process may use. Two hyperthreads of one core share
/// its load ports and FMA units, which these kernels keep busy, so a second thread per core
/// gains nothing and costs a wake-up per job; a second core nearly doubles the arithmetic and
/// adds memory bandwidth (measured on a 2-core Xeon: decode 16 → 22 tok/s on a 0.85B model).
pub fn default_threads() -> usize {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    physical_cores()
        .map_or(cpus, |cores| cores.min(cpus))
        .max(1)
}

/// Distinct (package, core) pairs among the CPUs this process may run on, from
/// `/proc/self/status` and `/sys/devices/system/cpu/cpu*/topology`.
fn physical_cores() -> Option<usize> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let allowed = status
        .lines()
        .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?;
    let mut cores = std::collections::HashSet::new();
    for cpu in parse_cpu_list(allowed)? {
        let topology = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
        let read = |name: &str| std::fs::read_to_string(format!("{topology}/{name}")).ok();
        cores.insert((read("physical_package_id")?, read("core_id")?));
    }
    (!cores.is_empty()).then_some(cores.len())
}

/// The CPUs of a Linux CPU list such as `0-3,8,10-11`.
fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.trim().split(',') {
        match part.split_once('-') {
            Some((a, b)) => cpus.extend(a.parse::<usize>().ok()?..=b.parse().ok()?),
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// Sets the number of threads the kernels use, the caller's included (at least 1).
pub fn set_threads(threads: usize) {
    let threads = threads.max(1);
    let mut p = pool().lock().unwrap();
    if p.threads != threads {
        let old = std::mem::replace(&mut *p, Pool::new(threads));
        old.shut_down();
    }
}

/// The number of threads the kernels use.
pub fn threads() -> usize {
    pool().lock().unwrap().threads
}

/// Runs `f(0..tasks)` on the pool's threads and the caller's, and returns when all have run.
pub fn parallel_for(tasks: usize, f: &(dyn Fn(usize) + Sync)) {
    let serial = || (0..tasks).for_each(f);
    if tasks <= 1 {
        return serial();
    }
    let Ok(p) = pool().try_lock() else {
        return serial();
    };
    if p.threads == 1 {
        drop(p);
        return serial();
    }
    let next = AtomicUsize::new(0);
    // SAFETY (lifetime): the workers drop these pointers before `busy` reaches zero, and this
    // function waits for that below.
    let f_static: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
    let job = Job {
        f: f_static,
        tasks,
        next: &next,
    };
    {
        let mut s = p.shared.state.lock().unwrap();
        s.generation += 1;
        s.job = Some(job);
        s.busy = p.workers.len();
    }
    p.shared.wake.notify_all();
    run_tasks(job);
    let mut s = p.shared.state.lock().unwrap();
    while s.busy > 0 {
        s = p.shared.done.wait(s).unwrap();
    }
    s.job = None;
}

/// A pointer to disjoint parts of an output that tasks write in parallel.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(*mut T, usize);

// SAFETY: tasks only write the disjoint ranges `range` hands them.
unsafe impl<T: Send> Send for SharedMut<T> {}
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub(crate) fn new(v: &mut [T]) -> Self {
        SharedMut(v.as_mut_ptr(), v.len())
    }

    /// A pointer to element `start`, checked to have `span` elements from there.
    pub(crate) fn ptr(&self, start: usize, span: usize) -> *mut T {
        assert!(start + span <= self.1);
        // SAFETY: in bounds, just checked.
        unsafe { self.0.add(start) }
    }

    /// Elements `start..start + len`.
    ///
    /// # Safety
    /// No two live slices from one `SharedMut` may overlap.
    #[allow(clippy::mut_from_ref)]
    pub(crate) unsafe fn range(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start + len <= self.1);
        // SAFETY: in bounds (just checked); disjointness is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_linux_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11\n"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn the_default_thread_count_is_within_the_cpus() {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!((1..=cpus).contains(&default_threads()));
    }

    #[test]
    fn every_task_runs_once_at_any_thread_count() {
        for threads in [1, 2, 3] {
            set_threads(threads);
            for tasks in [0, 1, 5, 64] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                parallel_for(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                    // A nested job runs serially rather than deadlocking.
                    parallel_for(2, &|_| {});
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
        set_threads(default_threads());
    }
}
