"""An independent, per-item, event-driven model of a cluster reading remote datasets.

Written from the model in docs/architecture.md and the SiloD paper, to check `silod simulate`
against. It imports nothing from the silod package and shares none of its code: a bug the
simulator has cannot be hidden by the same bug here.

The model, item by item:

- A dataset is `items` files of equal size. Every epoch a job reads each item once, in a fresh
  uniformly random order.
- A running job has a GPU that consumes items one after another, each in `item_size / f*`
  seconds, and a loader that looks items up in the cache ahead of the GPU, at most `window`
  items ahead. A hit is ready at once; a miss is fetched over the remote link, one fetch at a
  time per job.
- The remote link is shared by the fetches in flight (fluid processor sharing). With SiloD each
  job has a cap from the policy and the bandwidth that fetches in flight leave unused is split
  equally among them (work conservation); with the baselines the link is plainly shared.
- Caches act per item:
    silod   uniform per dataset: admit on a miss while the dataset holds fewer items than its
            allocation, never evict otherwise, evict random items when the allocation shrinks;
    alluxio one LRU over every dataset's items, admitting every fetched item and evicting the
            least recently used ones at admission so it never holds more than its capacity;
    coordl  each job caches uniformly into its own share (its GPUs' share of the cluster's
            cache), not shared with any other job and dropped when the job ends;
    quiver  whole datasets only, by benefit/cost (sum of f* of the running readers per byte);
            a dataset that does not fit the space left gets nothing; chosen ones fill uniformly.
- GPUs: FIFO in arrival order, a job starts when all its GPUs are free (later jobs that fit
  start first), and keeps them until it finishes.
- Curriculum jobs (SiloD §7.4, Eq. 10) have no epochs: the n-th item a job looks up is drawn
  uniformly from the g easiest items, g = floor(min(start * alpha^floor(i/step), 1) * N) (at
  least 1), at iteration i = n // batch; items are numbered easiest first. Their per-pass hit
  ratios are taken every N look-ups.
- Irregular partition (silod, `partition=True`): datasets read only by curriculum jobs are LRU
  caches, each limited to its share of the partition's cache; the partition gets the fraction
  s = (sum of f* of the running curriculum jobs) / (sum of f* of all running jobs) of the cache
  and the link; its cache is split among its datasets in proportion to the f* of their running
  readers (capped at the dataset, the rest to the others), its link max-min among its jobs by
  demand f* x (1 - cached/size). Regular jobs get the rest by the rule below. With
  `partition=False` curriculum jobs are planned like any other job by that rule (their miss
  ratio is that of the eligible items).
- CPU preprocessing (jobs with a `cpu_rate`, on a scenario with `cpus`): every item, hit or
  fetched, is then preprocessed before the GPU takes it, on the job's k cores: ceil(k) worker threads
  share the k cores (a cgroup quota), each busy thread at min(1, k / busy threads) cores, one
  item at a time per thread (a lone item never runs on more than one core). Cores are
  given at every event to the running jobs: `cpu_rule` "model" in descending cpu_rate / f*
  (the share of its speed a core buys), each up to f* / cpu_rate, until the cluster's cores are
  used; "gpu-proportional": cpus x gpus / cluster GPUs. The planning below then uses
  min(f*, k x cpu_rate) as the job's f*. Without `cpus` (or for a job without cpu_rate) items
  go straight from the loader to the GPU.
- Autocaching (silod, jobs with an `autocache` point (e, p)): a dataset whose running and
  queued readers all have the same expansion e may cache their preprocessed items instead of
  source items; such an item takes e x its bytes in cache and, when read from the cache, costs
  the CPU stage item_size / p per core instead of item_size / cpu_rate (a fetched item pays the
  whole pipeline). At every event, after the cache plan below, each such dataset compares its
  running readers' sum of min(f*, k / (h/p + (1-h)/r), link / (1-h)) / f* with h = c / (e d)
  (preprocessed) against h = c / d, k = 1/r (source), c the bytes the plan gives it; it switches
  when the other mode gains more than 0.05 (dropping what it cached) and the plan is redone at
  the new size -- but a dataset with more than 5% of its items cached as source items stays on
  source (a filled cache is not thrown away for a decoded copy).
- SiloD's allocation (FIFO form, recomputed at every event): cache per dataset by descending
  cache efficiency (sum of f*/d over the running jobs reading it; bytes not cached yet count
  only the readers with more than one pass left, since an item cached now helps its reader from
  the next pass on, and the readers of a dataset another running job reads, whose admissions
  serve them in this pass: `fresh_rule`); remote IO to the running jobs max-min fair by demand (SiloD §5.3: FIFO has no
  estimator to rank jobs by), a job's demand f* x (the miss ratio of what it still has to load
  this epoch).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RefJob:
    job_id: str
    submit: float
    gpus: int
    dataset: str
    ideal: float  # f*, bytes/s
    epochs: float  # work: items read = epochs x items of the dataset
    curriculum: tuple | None = None  # (starting_percent, alpha, step, batch) or None
    cpu_rate: float | None = None  # bytes/s one core preprocesses; None: no CPU stage
    autocache: tuple | None = None  # (expansion, post_cpu_rate) at the job's autocache point, or None


@dataclass(frozen=True)
class RefScenario:
    jobs: tuple[RefJob, ...]
    dataset_bytes: dict  # name -> bytes
    dataset_items: dict  # name -> item count
    gpus: int
    cache: float  # bytes, cluster total
    link: float  # bytes/s
    system: str  # silod | alluxio | coordl | quiver
    window: int = 32  # loader look-ahead, items
    partition: bool = True  # silod: curriculum jobs in the irregular partition (LRU)
    cpus: float | None = None  # cluster CPU cores (one node); None: no CPU stage
    cpu_rule: str = "model"  # model | gpu-proportional
    #: silod: which readers count for a dataset's bytes not cached yet: "co-reader" (readers
    #: with more than one pass left, and every reader of a dataset another running job reads:
    #: a co-reader's admissions serve its unread items), "last-epoch" (only readers with more
    #: than one pass left), "all" (every reader, Algorithm 2 as the paper writes it)
    fresh_rule: str = "co-reader"


@dataclass
class RefResult:
    jct: dict  # job id -> seconds
    start: dict
    epoch_hits: dict  # job id -> list of per-epoch hit ratios (complete epochs only)
    remote_bytes: dict


@dataclass
class _Run:
    spec: RefJob
    item_size: float
    n_items: int
    total: int  # items to consume in all
    rng: random.Random
    order: list = field(default_factory=list)
    looked: int = 0  # items the loader has looked up
    consumed: int = 0  # items the GPU has finished
    ready: int = 0  # items loaded and waiting for the GPU (looked-up - in flight - consumed)
    fetching: int | None = None  # item being fetched
    fetch_left: float = 0.0  # bytes left of the fetch
    gpu_busy_until: float | None = None
    unread: set = field(default_factory=set)  # items of the current epoch not looked up yet
    unread_cached: int = 0  # how many of them are cached now (kept by the silod cache's hooks)
    epoch_hits: list = field(default_factory=list)
    hits_now: int = 0
    looked_now: int = 0
    remote: float = 0.0
    start: float = 0.0
    cores: float = math.inf
    loaded: int = 0  # items loaded, waiting for a CPU worker
    loaded_pre: int = 0  # of those, preprocessed items read from the cache (autocaching)
    pre: tuple | None = None  # (e, p) while its dataset caches preprocessed items
    workers: list = field(default_factory=list)  # bytes left of the item on each worker thread, or None

    def worker_speed(self) -> float:
        """ceil(k) threads share k cores (a cgroup quota): each busy thread runs at
        min(1, k / busy) cores, so a lone item never gets more than one core."""
        busy = sum(1 for w in self.workers if w is not None)
        return 0.0 if busy == 0 else self.spec.cpu_rate * min(1.0, self.cores / busy)

    def ideal(self, hit: float = 0.0) -> float:
        """The GPU's rate, or what the cores can preprocess if less (at hit ratio `hit` when
        its dataset caches preprocessed items)."""
        if self.spec.cpu_rate is None or math.isinf(self.cores):
            return self.spec.ideal
        if self.pre is not None:
            return min(self.spec.ideal, self.cores / (hit / self.pre[1] + (1.0 - hit) / self.spec.cpu_rate))
        return min(self.spec.ideal, self.cores * self.spec.cpu_rate)

    def eligible(self, n: int) -> int:
        """How many of the easiest items the n-th look-up of a curriculum job draws from."""
        start, alpha, step, batch = self.spec.curriculum
        frac = min(start * alpha ** ((n // batch) // step), 1.0)
        return max(1, min(self.n_items, int(math.floor(frac * self.n_items * (1 + 1e-12)))))

    def epoch_order(self) -> None:
        self.order = list(range(self.n_items))
        self.rng.shuffle(self.order)
        self.unread = set(self.order)


class _Uniform:
    """Uniform cache of one dataset (or one job's private share).

    `readers` are the runs whose count of cached-and-unread items must follow every change.
    """

    def __init__(self, rng: random.Random):
        self.items: set = set()
        self.limit = 0
        self.rng = rng
        self.readers: list = []

    def set_limit(self, n: int) -> None:
        self.limit = max(0, n)
        if len(self.items) > self.limit:
            victims = self.rng.sample(sorted(self.items), len(self.items) - self.limit)
            self.items.difference_update(victims)
            for r in self.readers:
                r.unread_cached -= sum(1 for v in victims if v in r.unread)

    def admit(self, item) -> None:
        if len(self.items) < self.limit and item not in self.items:
            self.items.add(item)
            for r in self.readers:
                if item in r.unread:
                    r.unread_cached += 1


class _Lru:
    """LRU cache of one dataset with a limit (the irregular partition)."""

    def __init__(self):
        self.items: OrderedDict = OrderedDict()
        self.limit = 0
        self.readers: list = []

    def set_limit(self, n: int) -> None:
        self.limit = max(0, n)
        while len(self.items) > self.limit:
            self.items.popitem(last=False)

    def admit(self, item) -> None:
        if self.limit <= 0:
            return
        if item in self.items:
            self.items.move_to_end(item)
            return
        self.items[item] = None
        while len(self.items) > self.limit:
            self.items.popitem(last=False)


def _max_min(demands: dict, total: float) -> dict:
    """Max-min fair split of `total` by demand (water-filling)."""
    give = {k: 0.0 for k in demands}
    left = total
    want = {k: v for k, v in demands.items() if v > 0}
    while want and left > 1e-12:
        each = left / len(want)
        small = {k: v for k, v in want.items() if v <= each}
        if not small:
            for k in want:
                give[k] += each
            break
        for k, v in small.items():
            give[k] += v
            left -= v
            del want[k]
    return give


def simulate(sc: RefScenario, seed: int = 0) -> RefResult:
    rng = random.Random(seed)
    pending = sorted(sc.jobs, key=lambda j: (j.submit, j.job_id))
    running: list[_Run] = []
    done: dict = {}
    starts: dict = {}
    hits: dict = {}
    remote: dict = {}
    free_gpus = sc.gpus
    now = 0.0
    queue: list[RefJob] = []
    uniform: dict = {}  # dataset (or job id for coordl) -> _Uniform (or _Lru: irregular partition)
    lru: OrderedDict = OrderedDict()  # (dataset, item) -> None, least recent first
    lru_bytes = 0.0
    item_size = {d: sc.dataset_bytes[d] / sc.dataset_items[d] for d in sc.dataset_bytes}
    mode: dict = {}  # dataset -> (e, p) while it caches preprocessed items (autocaching)

    def expansion(ds) -> float:
        return mode[ds][0] if ds in mode else 1.0

    def cached(run: _Run, item) -> bool:
        if sc.system == "alluxio":
            return (run.spec.dataset, item) in lru
        key = run.spec.job_id if sc.system == "coordl" else run.spec.dataset
        u = uniform.get(key)
        return u is not None and item in u.items

    def touch(run: _Run, item) -> None:
        if sc.system == "alluxio":
            lru.move_to_end((run.spec.dataset, item))
        elif isinstance(uniform.get(run.spec.dataset), _Lru):
            uniform[run.spec.dataset].items.move_to_end(item)

    def admit(run: _Run, item) -> None:
        nonlocal lru_bytes
        if sc.system == "alluxio":
            size = item_size[run.spec.dataset]
            if size > sc.cache:
                return
            key = (run.spec.dataset, item)
            if key in lru:
                lru.move_to_end(key)
                return
            lru[key] = None
            lru_bytes += size
            while lru_bytes > sc.cache + 1e-6:
                (ds, _), _ = lru.popitem(last=False)
                lru_bytes -= item_size[ds]
            return
        key = run.spec.job_id if sc.system == "coordl" else run.spec.dataset
        u = uniform.get(key)
        if u is not None:
            u.admit(item)

    def rest_hit_ratio(run: _Run) -> float:
        """Cached share of what the job still has to load this epoch (silod only): the items not
        looked up yet, plus the miss in flight; at an epoch's end, the cached share of the whole
        dataset (what the next epoch will see)."""
        u = uniform.get(run.spec.dataset)
        if run.spec.curriculum is not None:
            g = run.eligible(run.looked)
            return 0.0 if u is None else sum(1 for i in u.items if i < g) / g
        in_flight = 1 if run.fetching is not None else 0
        if not run.unread and not in_flight:
            return 0.0 if u is None or run.looked >= run.total else len(u.items) / run.n_items
        return run.unread_cached / (len(run.unread) + in_flight)

    def plan_regular(regular: list, cache: float, link: float) -> dict:
        """Cache limits and IO caps of the regular jobs (FIFO form of SiloD's allocation)."""
        # Greedy by cache efficiency, with delayed effectiveness: bytes already cached save
        # f*/d for every reader; bytes still to be cached only for readers that will read
        # the dataset again after this epoch (more than one pass of work left).
        eff_cached: dict = {}
        eff_new: dict = {}
        for r in regular:
            ds = r.spec.dataset
            e = r.ideal() / sc.dataset_bytes[ds]
            eff_cached[ds] = eff_cached.get(ds, 0.0) + e
            shared = sum(1 for o in regular if o.spec.dataset == ds) > 1
            counts = (sc.fresh_rule == "all" or r.total - r.consumed > r.n_items
                      or (sc.fresh_rule == "co-reader" and shared))
            eff_new[ds] = eff_new.get(ds, 0.0) + (e if counts else 0.0)
        def cache_plan() -> dict:
            pieces = []  # (efficiency per cache byte, dataset, cache bytes)
            for ds in eff_cached:
                e = expansion(ds)
                have = min(len(uniform[ds].items) * item_size[ds] * e, sc.dataset_bytes[ds] * e) if ds in uniform else 0.0
                pieces.append((eff_cached[ds] / e, ds, have))
                pieces.append((eff_new[ds] / e, ds, sc.dataset_bytes[ds] * e - have))
            give: dict = {ds: 0.0 for ds in eff_cached}
            left = cache
            for eff, ds, nbytes in sorted(pieces, key=lambda p: (-p[0], p[1])):
                take = min(left, nbytes)
                give[ds] += take
                left -= take
            return give

        give = cache_plan()
        switched = False
        for ds in give:
            points = {j.autocache for j in sc.jobs if j.dataset == ds and (j in queue or any(r.spec is j for r in running))}
            if len(points) != 1 or None in points:
                continue
            e, p = next(iter(points))
            d = sc.dataset_bytes[ds]
            gain = 0.0
            for r in regular:
                if r.spec.dataset != ds or r.spec.cpu_rate is None:
                    continue
                k = r.cores
                rr = r.spec.cpu_rate
                speeds = []
                for h, hp in ((min(give[ds] / d, 1.0), rr), (min(give[ds] / (e * d), 1.0), p)):
                    cpu = math.inf if math.isinf(k) else k / (h / hp + (1.0 - h) / rr)
                    io = math.inf if h >= 1.0 else sc.link / (1.0 - h)
                    speeds.append(min(r.spec.ideal, cpu, io))
                gain += (speeds[1] - speeds[0]) / r.spec.ideal
            now_pre = ds in mode
            fresh = ds not in uniform or len(uniform[ds].items) <= 0.05 * sc.dataset_items[ds]
            want_pre = (gain > 0.05 and (now_pre or fresh)) or (now_pre and gain > -0.05)
            if want_pre != now_pre:
                if ds in uniform:
                    uniform[ds].set_limit(0)  # source and preprocessed items are different bytes
                if want_pre:
                    mode[ds] = (e, p)
                else:
                    mode.pop(ds)
                switched = True
        if switched:
            give = cache_plan()
        for r in regular:
            r.pre = mode.get(r.spec.dataset)
        for ds, nbytes in give.items():
            u = uniform.get(ds)
            if not isinstance(u, _Uniform):  # new, or leaving the irregular partition
                old, u = u, _Uniform(rng)
                uniform[ds] = u
                if old is not None:
                    u.items = set(old.items)
            u.readers = [r for r in regular if r.spec.dataset == ds]
            u.set_limit(int(math.floor(nbytes / (item_size[ds] * expansion(ds)) + 1e-9)))
        # SiloD §5.3: FIFO runs with the greedy policy, which ranks no job for IO: the link is
        # shared max-min by demand.
        wants = {}
        for r in regular:
            hit = rest_hit_ratio(r)
            wants[r.spec.job_id] = r.ideal(hit) * (1.0 - hit)
        return _max_min(wants, link)

    def plan_irregular(irregular: list, lru_ds: set, cache: float, link: float) -> dict:
        """LRU limits of the irregular partition's datasets and IO caps of its jobs."""
        rate: dict = {}
        for r in irregular:
            if r.spec.dataset in lru_ds:
                rate[r.spec.dataset] = rate.get(r.spec.dataset, 0.0) + r.spec.ideal
        give = {ds: 0.0 for ds in rate}
        left, open_ = cache, set(rate)
        while open_ and left > 1e-6:
            total = sum(rate[d] for d in open_)
            full = {d for d in open_ if left * rate[d] / total >= sc.dataset_bytes[d] - give[d]}
            if not full:
                for d in open_:
                    give[d] += left * rate[d] / total
                break
            for d in full:
                left -= sc.dataset_bytes[d] - give[d]
                give[d] = sc.dataset_bytes[d]
            open_ -= full
        for ds, nbytes in give.items():
            u = uniform.get(ds)
            if not isinstance(u, _Lru):  # new, or joining the irregular partition
                old, u = u, _Lru()
                uniform[ds] = u
                for i in sorted(old.items) if old is not None else ():
                    u.items[i] = None
            u.set_limit(int(math.floor(nbytes / item_size[ds] + 1e-9)))
        demand = {}
        for r in irregular:
            u = uniform.get(r.spec.dataset)
            cached = len(u.items) if u is not None else 0
            demand[r.spec.job_id] = r.spec.ideal * (1.0 - min(cached / r.n_items, 1.0))
        return _max_min(demand, link)

    def allocate_cpu() -> None:
        """Cores per running job (see the module docstring), and its workers' speeds."""
        if sc.cpus is None:
            return
        staged = [r for r in running if r.spec.cpu_rate is not None]
        if sc.cpu_rule == "gpu-proportional":
            cores = {r.spec.job_id: sc.cpus * r.spec.gpus / sc.gpus for r in staged}
        else:
            cores, left = {}, sc.cpus
            for r in sorted(staged, key=lambda r: (-r.spec.cpu_rate / r.spec.ideal, r.spec.submit, r.spec.job_id)):
                cores[r.spec.job_id] = min(r.spec.ideal / r.spec.cpu_rate, left)
                left -= cores[r.spec.job_id]
        for r in staged:
            k = cores[r.spec.job_id]
            if k == r.cores:
                continue
            r.cores = k
            busy = [left for left in r.workers if left is not None]
            r.workers = [None] * int(math.ceil(k - 1e-12))
            for i in range(min(len(busy), len(r.workers))):  # items in progress keep what is done
                r.workers[i] = busy.pop(0)
            r.loaded += len(busy)  # more items in progress than workers now: back in the queue

    def deliver(run: _Run, hit: bool = False) -> None:
        """An item is loaded (hit or fetched): to the CPU stage if the job has one, else ready."""
        if run.workers or (sc.cpus is not None and run.spec.cpu_rate is not None):
            run.loaded += 1
            if hit and run.pre is not None:
                run.loaded_pre += 1
        else:
            run.ready += 1

    def start_cpu(run: _Run) -> None:
        for i, w in enumerate(run.workers):
            if w is None and run.loaded > 0:
                run.loaded -= 1
                if run.loaded_pre > 0 and run.pre is not None:  # a cached preprocessed item: only the rest of the pipeline
                    run.loaded_pre -= 1
                    run.workers[i] = run.item_size * run.spec.cpu_rate / run.pre[1]
                else:
                    run.workers[i] = run.item_size

    def allocate_storage() -> dict:
        """Cache limits (uniform systems) and IO caps (silod); returns job id -> cap or None."""
        if sc.system == "silod":
            irregular = [r for r in running if sc.partition and r.spec.curriculum is not None]
            regular = [r for r in running if r not in irregular]
            lru_ds = {r.spec.dataset for r in irregular} - {r.spec.dataset for r in regular}
            share = sum(r.spec.ideal for r in irregular) / sum(r.spec.ideal for r in running) if irregular else 0.0
            caps = plan_irregular(irregular, lru_ds, sc.cache * share, sc.link * share) if irregular else {}
            caps.update(plan_regular(regular, sc.cache * (1 - share), sc.link * (1 - share)))
            for ds, u in uniform.items():
                if ds not in lru_ds and not any(r.spec.dataset == ds for r in regular):
                    u.readers = []
                    u.set_limit(0)
            return caps
        if sc.system == "quiver":
            benefit: dict = {}
            for r in running:
                benefit[r.spec.dataset] = benefit.get(r.spec.dataset, 0.0) + r.spec.ideal
            left = sc.cache
            chosen = set()
            for ds in sorted(benefit, key=lambda d: -benefit[d] / sc.dataset_bytes[d]):
                if sc.dataset_bytes[ds] <= left + 1e-6:
                    chosen.add(ds)
                    left -= sc.dataset_bytes[ds]
            for ds in set(uniform) | chosen:
                u = uniform.setdefault(ds, _Uniform(rng))
                u.set_limit(sc.dataset_items[ds] if ds in chosen else 0)
        return {}

    def link_rates(caps: dict) -> dict:
        active = [r for r in running if r.fetching is not None]
        if not active:
            return {}
        if sc.system != "silod":
            return {r.spec.job_id: sc.link / len(active) for r in active}
        rates = {r.spec.job_id: caps.get(r.spec.job_id, 0.0) for r in active}
        spare = sc.link - sum(rates.values())
        if spare > 1e-12:
            for r in active:
                rates[r.spec.job_id] += spare / len(active)
        return rates

    def loader_step(run: _Run) -> None:
        """Look items up until a miss is in flight or the window is full."""
        while run.fetching is None and run.looked < run.total and run.looked - run.consumed < sc.window:
            pos = run.looked % run.n_items
            if pos == 0:
                if run.looked > 0:
                    run.epoch_hits.append(run.hits_now / run.looked_now)
                run.hits_now = run.looked_now = 0
                if run.spec.curriculum is None:
                    run.epoch_order()
                    u = uniform.get(run.spec.dataset) if sc.system == "silod" else None
                    run.unread_cached = len(u.items) if u is not None else 0
            if run.spec.curriculum is not None:
                item = run.rng.randrange(run.eligible(run.looked))
            else:
                item = run.order[pos]
            run.unread.discard(item)
            if sc.system == "silod" and cached(run, item):
                run.unread_cached -= 1
            run.looked += 1
            run.looked_now += 1
            if cached(run, item):
                touch(run, item)
                run.hits_now += 1
                deliver(run, hit=True)
            else:
                run.fetching = item
                run.fetch_left = run.item_size

    def start_gpu(run: _Run, t: float) -> None:
        if run.gpu_busy_until is None and run.ready > 0:
            run.ready -= 1
            run.gpu_busy_until = t + run.item_size / run.spec.ideal

    def admit_jobs(t: float) -> None:
        nonlocal free_gpus
        for job in list(queue):
            if job.gpus <= free_gpus:
                free_gpus -= job.gpus
                queue.remove(job)
                n = sc.dataset_items[job.dataset]
                r = _Run(job, item_size[job.dataset], n, max(1, int(round(job.epochs * n))), random.Random(rng.random()))
                r.start = t
                starts[job.job_id] = t
                if sc.system == "coordl":
                    u = uniform[job.job_id] = _Uniform(rng)
                    u.set_limit(int(math.floor(sc.cache * job.gpus / sc.gpus / r.item_size + 1e-9)))
                running.append(r)

    while pending or queue or running:
        while pending and pending[0].submit <= now + 1e-9:
            queue.append(pending.pop(0))
        admit_jobs(now)
        allocate_cpu()
        caps = allocate_storage()
        for r in running:
            loader_step(r)
            start_cpu(r)
            start_gpu(r, now)
        caps = allocate_storage()  # loader look-ups changed the rest-of-epoch ratios
        rates = link_rates(caps)
        # Next event: an arrival, a GPU finishing an item, or a fetch completing.
        t_next = pending[0].submit if pending else math.inf
        for r in running:
            if r.gpu_busy_until is not None:
                t_next = min(t_next, r.gpu_busy_until)
            rate = rates.get(r.spec.job_id, 0.0)
            if r.fetching is not None and rate > 0:
                t_next = min(t_next, now + r.fetch_left / rate)
            speed = r.worker_speed() if r.workers else 0.0
            for left in r.workers:
                if left is not None and speed > 0:
                    t_next = min(t_next, now + left / speed)
        if t_next == math.inf:
            raise RuntimeError("reference model stalled: no event can happen (no bandwidth for a miss?)")
        dt = t_next - now
        for r in running:
            if r.fetching is not None:
                r.fetch_left -= rates.get(r.spec.job_id, 0.0) * dt
            speed = r.worker_speed() if r.workers else 0.0
            r.workers = [None if w is None else w - speed * dt for w in r.workers]
        now = t_next
        for r in list(running):
            if r.fetching is not None and r.fetch_left <= 1e-6 * r.item_size:
                r.remote += r.item_size
                admit(r, r.fetching)
                r.fetching = None
                deliver(r)
            for i, w in enumerate(r.workers):
                if w is not None and w <= 1e-6 * r.item_size:
                    r.workers[i] = None
                    r.ready += 1
            if r.gpu_busy_until is not None and r.gpu_busy_until <= now + 1e-9:
                r.gpu_busy_until = None
                r.consumed += 1
                if r.consumed >= r.total:
                    if r.looked_now == r.n_items:
                        r.epoch_hits.append(r.hits_now / r.looked_now)
                    running.remove(r)
                    free_gpus += r.spec.gpus
                    done[r.spec.job_id] = now - r.spec.submit
                    hits[r.spec.job_id] = r.epoch_hits
                    remote[r.spec.job_id] = r.remote
                    if sc.system == "coordl":
                        uniform.pop(r.spec.job_id, None)
    return RefResult(done, starts, hits, remote)
