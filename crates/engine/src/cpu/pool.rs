//! The kernels' thread pool: persistent workers that sleep on a condition variable between jobs
//! and never spin, because spinning workers on hyperthreads of one core (a common 2-vCPU cloud
//! machine), or on cores other programs also use, take the core from the thread doing the work.
//! One thread per physical core by default ([`default_threads`]).
//!
//! A job is a number of tasks claimed from a shared counter by the caller and the workers
//! alike; the caller returns once every task has run, without waiting for workers that woke too
//! late to claim one (on a machine where other programs hold the cores, a sleeping worker can
//! take longer to wake than a small job takes to run). Jobs do not nest: a job started while
//! another runs (from a task, or from a second caller thread) runs on its caller alone.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::thread::JoinHandle;

/// One job as the workers see it: `f` lives on the caller's stack, which [`parallel_for`] does
/// not leave until every task has run; a task is only run after claiming it (see [`claim`]).
#[derive(Clone, Copy)]
struct Job {
    f: *const (dyn Fn(usize) + Sync),
    tasks: usize,
    generation: u32,
}

// SAFETY: `f` is only dereferenced while `parallel_for` keeps its target alive (a claimed task
// of the current job has not finished), and the target is `Sync`.
unsafe impl Send for Job {}

struct State {
    generation: u32,
    job: Option<Job>,
    stop: bool,
}

struct Shared {
    state: Mutex<State>,
    wake: Condvar,
    done: Condvar,
    /// The current job's generation (high 32 bits) and next unclaimed task (low 32 bits), so that
    /// a worker still holding an older job can never claim one of this job's tasks.
    claims: AtomicU64,
    /// Tasks of the current job that have run.
    finished: AtomicUsize,
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
                stop: false,
            }),
            wake: Condvar::new(),
            done: Condvar::new(),
            claims: AtomicU64::new(0),
            finished: AtomicUsize::new(0),
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

/// Claims the next task of `job`, if `job` is still the current job and has one left.
fn claim(shared: &Shared, job: &Job) -> Option<usize> {
    let mut v = shared.claims.load(Ordering::Acquire);
    loop {
        let (generation, next) = ((v >> 32) as u32, v as u32 as usize);
        if generation != job.generation || next >= job.tasks {
            return None;
        }
        match shared
            .claims
            .compare_exchange_weak(v, v + 1, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => return Some(next),
            Err(now) => v = now,
        }
    }
}

fn run_tasks(shared: &Shared, job: &Job) {
    while let Some(i) = claim(shared, job) {
        // SAFETY: see `Job`: task `i` is claimed and has not finished.
        unsafe { (*job.f)(i) };
        if shared.finished.fetch_add(1, Ordering::AcqRel) + 1 == job.tasks {
            // Under the lock, so that the caller cannot miss the wake-up between its check and
            // its wait.
            let _state = shared.state.lock().unwrap();
            shared.done.notify_all();
        }
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
            run_tasks(shared, &job);
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
/// adds memory bandwidth (a 2-core Xeon decodes a 0.85B model about 40% faster on both cores
/// than on one).
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
    assert!(tasks <= u32::MAX as usize);
    // SAFETY (lifetime): the pointer is only used for claimed tasks, all of which finish before
    // this function returns (it waits for that below).
    let f_static: *const (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(f) };
    let shared = &*p.shared;
    let job = {
        let mut s = shared.state.lock().unwrap();
        s.generation = s.generation.wrapping_add(1);
        let job = Job {
            f: f_static,
            tasks,
            generation: s.generation,
        };
        shared.finished.store(0, Ordering::Relaxed);
        shared
            .claims
            .store((job.generation as u64) << 32, Ordering::Release);
        s.job = Some(job);
        job
    };
    shared.wake.notify_all();
    run_tasks(shared, &job);
    let mut s = shared.state.lock().unwrap();
    while shared.finished.load(Ordering::Acquire) < tasks {
        s = shared.done.wait(s).unwrap();
    }
    s.job = None;
}

/// Work below this many bytes of weights (about 80 µs of streaming on one core) runs on the
/// calling thread alone: waking a sleeping worker takes tens of microseconds (30-60 µs in a
/// KVM guest), so smaller jobs finish sooner without it.
pub(crate) const PARALLEL_MIN_BYTES: usize = 1 << 20;

/// [`parallel_for`] for tasks that together read `bytes` of weights: on the caller alone below
/// [`PARALLEL_MIN_BYTES`].
pub(crate) fn parallel_for_bytes(tasks: usize, bytes: usize, f: &(dyn Fn(usize) + Sync)) {
    if bytes < PARALLEL_MIN_BYTES {
        (0..tasks).for_each(f)
    } else {
        parallel_for(tasks, f)
    }
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

    /// Jobs far shorter than a wake-up: late workers must neither run a later job's tasks with
    /// an earlier job's function nor hold the caller.
    #[test]
    fn back_to_back_small_jobs_run_every_task_once() {
        set_threads(3);
        for job in 0..20_000 {
            let tasks = 2 + job % 5;
            let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
            parallel_for(tasks, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            });
            assert!(
                hits.iter().all(|h| h.load(Ordering::Relaxed) == 1),
                "job {job}"
            );
        }
        set_threads(default_threads());
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
