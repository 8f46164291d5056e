"""An exact count of CPU allocator bytes: every allocation and free of CPU memory that goes through torch's CPU
allocator (every CPU tensor storage), whichever thread frees it.

``torch.profiler``'s memory events, and the running total beside them, only hear allocator calls made on a thread
that carries the profiler's thread-local state: a gloo worker thread that drops the last reference to a finished
collective's tensors frees them unheard, so a profiler-only count drifts up. This module wraps the CPU allocator
that torch has installed (``c10::GetCPUAllocator()``) in a small native allocator, built at first use with
``torch.utils.cpp_extension`` (cached per user and torch version under ``~/.cache/ragged_optim``, so spawned
or later processes load the built library at once) and installed with ``c10::SetCPUAllocator`` at the highest
priority. It counts the bytes asked for in ``allocate`` and gives them back in the deleter of the storage, on
whatever thread that runs, under one mutex; the inner allocator still does the work (and still reports to the
profiler, which therefore keeps working for attribution).

What it counts: storages (and ``raw_allocate`` buffers, e.g. oneDNN's through ideep) allocated after
:func:`install`, and their resizes; memory allocated before it is neither counted nor subtracted when freed. What it
does not see: memory that does not go through the current CPU allocator: Python's ``torch.UntypedStorage(n)``
constructor (it asks for torch's default CPU allocator by name; ``torch.empty`` and every op go through the current
one), ``torch.from_numpy`` and other foreign buffers, shared-memory and file-mapped storages, pinned host memory,
CUDA; nor malloc calls of libraries outside torch's allocator (gloo's transport buffers, oneDNN's own scratch when it
does not ask torch). torch's CPU caching allocator is used only by its static runtime, not by eager code.

Beside the count it keeps the moment of the peak (an event sequence number and the phase that Python last set with
:func:`set_phase`), and while recording (:func:`start_recording`) a log of events that gives the allocations live at
the peak, each marked with whether the profiler heard it (so it can be matched to the profiler's event and its site).

A process that cannot build it (no compiler, no ninja) gets a RuntimeError that says so: there is no fallback to a
count that is not exact.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import shutil
import sys
import threading
from dataclasses import dataclass

import torch

_SOURCE = r"""
// ragged_optim's counting CPU allocator (see ragged_optim/alloc_counter.py).
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

struct Live {
  int64_t size;
  uint64_t seq;
  void* ctx;                  // the inner allocator's context and deleter: called at the free
  c10::DeleterFnPtr deleter;
  bool heard;                 // the profiler heard the allocation (it was enabled on the allocating thread)
  uint32_t thread;
};

struct Event {                // the log while recording; size < 0 is a free
  uint64_t seq;
  void* ptr;
  int64_t size;
  bool heard;
  uint32_t thread;
};

struct State {
  std::mutex mu;
  std::unordered_map<void*, Live> live;
  int64_t current = 0, peak = 0;
  uint64_t seq = 0, peak_seq = 0;
  int64_t phase = 0, peak_phase = 0;
  uint64_t n_alloc = 0, n_free = 0;
  int64_t unheard_free_bytes = 0;   // heard at allocation, freed where the profiler does not listen
  uint64_t unheard_free_count = 0;
  bool recording = false;
  std::vector<Event> log;
};

State& st() {
  static State* s = new State();  // never destroyed: storages are still freed while the process exits
  return *s;
}

std::atomic<uint32_t> next_thread{0};
uint32_t this_thread() {
  thread_local uint32_t id = next_thread.fetch_add(1);
  return id;
}

c10::Allocator* g_inner = nullptr;
uint32_t g_install_thread = 0;

void counted_delete(void* p) {
  if (p == nullptr) return;
  void* ctx = nullptr;
  c10::DeleterFnPtr deleter = nullptr;
  {
    State& s = st();
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.live.find(p);
    if (it == s.live.end()) {
      // raw_deallocate through the current allocator of memory that the inner one gave out before install
      // (ideep asks c10::GetAllocator at each call): not counted, so not subtracted
      deleter = g_inner->raw_deleter();
      ctx = p;
    } else {
    const Live& l = it->second;
    ctx = l.ctx;
    deleter = l.deleter;
    s.current -= l.size;
    s.n_free += 1;
    bool heard_now = c10::memoryProfilingEnabled();
    if (l.heard && !heard_now) {
      s.unheard_free_bytes += l.size;
      s.unheard_free_count += 1;
    }
    uint64_t seq = ++s.seq;
    if (s.recording) s.log.push_back(Event{seq, p, -l.size, heard_now, this_thread()});
    s.live.erase(it);  // before the inner free: the address may be handed out again right after it
    }
  }
  if (deleter != nullptr) deleter(ctx);
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    c10::DataPtr d = g_inner->allocate(n);
    void* p = d.get();
    c10::Device device = d.device();
    if (p == nullptr) return c10::DataPtr(nullptr, nullptr, &counted_delete, device);
    c10::DeleterFnPtr deleter = d.get_deleter();
    void* ctx = d.release_context();
    bool heard = c10::memoryProfilingEnabled();
    int64_t size = static_cast<int64_t>(n);
    {
      State& s = st();
      std::lock_guard<std::mutex> g(s.mu);
      uint64_t seq = ++s.seq;
      s.live[p] = Live{size, seq, ctx, deleter, heard, this_thread()};
      s.current += size;
      s.n_alloc += 1;
      if (s.current > s.peak) {
        s.peak = s.current;
        s.peak_seq = seq;
        s.peak_phase = s.phase;
      }
      if (s.recording) s.log.push_back(Event{seq, p, size, heard, this_thread()});
    }
    return c10::DataPtr(p, p, &counted_delete, device);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return &counted_delete;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator g_counting;

// fork (run_on_ranks forks its ranks) while another thread holds the mutex would leave the child's copy locked
void prefork() { st().mu.lock(); }
void postfork() { st().mu.unlock(); }

bool install(int priority) {
  if (c10::GetCPUAllocator() == &g_counting) return false;
  TORCH_CHECK(g_inner == nullptr, "ragged_optim alloc_counter: was installed once and has been replaced since");
  g_inner = c10::GetCPUAllocator();
  c10::SetCPUAllocator(&g_counting, static_cast<uint8_t>(priority));
  TORCH_CHECK(c10::GetCPUAllocator() == &g_counting,
              "ragged_optim alloc_counter: c10::SetCPUAllocator did not take effect (an allocator of higher "
              "priority is installed)");
  g_install_thread = this_thread();
  pthread_atfork(prefork, postfork, postfork);
  return true;
}

bool installed() { return g_inner != nullptr && c10::GetCPUAllocator() == &g_counting; }

// (current, peak, peak_seq, peak_phase, seq, n_alloc, n_free, unheard_free_bytes, unheard_free_count, live count)
std::tuple<int64_t, int64_t, uint64_t, int64_t, uint64_t, uint64_t, uint64_t, int64_t, uint64_t, uint64_t> stats() {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  return {s.current, s.peak, s.peak_seq, s.peak_phase, s.seq, s.n_alloc, s.n_free, s.unheard_free_bytes,
          s.unheard_free_count, static_cast<uint64_t>(s.live.size())};
}

// the peak so far (peak, peak_seq, peak_phase); the peak starts again from the bytes allocated now
std::tuple<int64_t, uint64_t, int64_t> reset_peak() {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  std::tuple<int64_t, uint64_t, int64_t> old{s.peak, s.peak_seq, s.peak_phase};
  s.peak = s.current;
  s.peak_seq = s.seq;
  s.peak_phase = s.phase;
  return old;
}

// an outer measurement's peak back after an inner one reset it (kept where it is higher)
void restore_peak(int64_t peak, uint64_t peak_seq, int64_t peak_phase) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  if (peak > s.peak) {
    s.peak = peak;
    s.peak_seq = peak_seq;
    s.peak_phase = peak_phase;
  }
}

int64_t set_phase(int64_t phase) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  int64_t old = s.phase;
  s.phase = phase;
  return old;
}

// the log starts with what is live now (not heard: no profile that starts later saw it)
void start_recording() {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  s.log.clear();
  s.log.reserve(s.live.size() + 4096);
  std::vector<Event> now;
  for (const auto& kv : s.live) now.push_back(Event{kv.second.seq, kv.first, kv.second.size, false, kv.second.thread});
  std::sort(now.begin(), now.end(), [](const Event& a, const Event& b) { return a.seq < b.seq; });
  s.log = std::move(now);
  s.recording = true;
}

uint64_t stop_recording() {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  s.recording = false;
  return s.log.size();
}

// allocations live just after event `seq`, replayed from the log: (ptr, size, seq, heard, thread, ordinal), where
// ordinal counts the heard allocations of the same (ptr, size) in the log before this one (the profiler's events
// of that address and size, in time order, have the same ordinals)
std::vector<std::tuple<uintptr_t, int64_t, uint64_t, bool, uint32_t, int64_t>> live_at(uint64_t seq) {
  State& s = st();
  std::lock_guard<std::mutex> g(s.mu);
  struct Entry { int64_t size; uint64_t seq; bool heard; uint32_t thread; int64_t ordinal; };
  std::unordered_map<void*, Entry> cur;
  std::unordered_map<void*, std::unordered_map<int64_t, int64_t>> heard_count;
  for (const Event& e : s.log) {
    if (e.seq > seq) break;
    if (e.size > 0) {
      int64_t ordinal = -1;
      if (e.heard) ordinal = heard_count[e.ptr][e.size]++;
      cur[e.ptr] = Entry{e.size, e.seq, e.heard, e.thread, ordinal};
    } else {
      cur.erase(e.ptr);
    }
  }
  std::vector<std::tuple<uintptr_t, int64_t, uint64_t, bool, uint32_t, int64_t>> out;
  out.reserve(cur.size());
  for (const auto& kv : cur)
    out.emplace_back(reinterpret_cast<uintptr_t>(kv.first), kv.second.size, kv.second.seq, kv.second.heard,
                     kv.second.thread, kv.second.ordinal);
  return out;
}

uint32_t thread_index() { return this_thread(); }
uint32_t install_thread() { return g_install_thread; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("stats", &stats);
  m.def("reset_peak", &reset_peak);
  m.def("restore_peak", &restore_peak);
  m.def("set_phase", &set_phase);
  m.def("start_recording", &start_recording);
  m.def("stop_recording", &stop_recording);
  m.def("live_at", &live_at, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("thread_index", &thread_index);
  m.def("install_thread", &install_thread);
}
"""

_lock = threading.Lock()
_module = None


def _cache_dir(name: str) -> str:
    root = os.environ.get("RAGGED_OPTIM_EXT_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ragged_optim"
    )
    return os.path.join(root, name)


def _name() -> str:
    tag = f"{torch.__version__}|{sys.version_info[:2]}|{torch._C._GLIBCXX_USE_CXX11_ABI}|{_SOURCE}"
    return "ro_alloc_counter_" + hashlib.sha256(tag.encode()).hexdigest()[:16]


def _put_ninja_on_path() -> None:
    """cpp_extension runs ``ninja`` from PATH; the pip package's (the dev extras') is in the venv's bin folder,
    which is not on PATH when the venv's python is run without activating it."""
    if shutil.which("ninja"):
        return
    dirs = [os.path.dirname(sys.executable)]
    try:
        import ninja

        dirs.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in dirs:
        if os.path.exists(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return


def _import_built(name: str, path: str):
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def native():
    """The native module, built on first use (tens of seconds on 2 cores) and loaded from the cache after."""
    global _module
    if _module is not None:
        return _module
    with _lock:
        if _module is not None:
            return _module
        name = _name()
        build_dir = _cache_dir(name)
        so_path = os.path.join(build_dir, name + ".so")
        done = os.path.join(build_dir, "built")  # written once the library is whole (another process may be linking)
        if os.path.exists(done) and os.path.exists(so_path):
            _module = _import_built(name, so_path)
            return _module
        from torch.utils import cpp_extension

        _put_ninja_on_path()
        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            raise RuntimeError(
                "ragged_optim's exact CPU memory count builds a small native allocator hook at first use and "
                "torch.utils.cpp_extension needs ninja for that: `pip install ninja` (in the dev extras) or your "
                "system's ninja-build. There is no fallback: the profiler's count misses frees on worker threads."
            ) from None
        os.makedirs(build_dir, exist_ok=True)
        src = os.path.join(build_dir, "alloc_counter.cpp")
        if not os.path.exists(src):
            tmp = f"{src}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(_SOURCE)
            os.replace(tmp, src)
        try:
            _module = cpp_extension.load(
                name, [src], build_directory=build_dir, extra_cflags=["-O2"], verbose=False, with_cuda=False
            )
        except Exception as e:
            raise RuntimeError(
                f"ragged_optim's exact CPU memory count could not build its native allocator hook in {build_dir} "
                f"({type(e).__name__}: {str(e)[-2000:]}); it needs a C++ compiler (g++) and ninja. There is no "
                "fallback: the profiler's count misses frees on worker threads."
            ) from e
        with open(done, "w") as f:
            f.write(so_path + "\n")
        return _module


def install() -> None:
    """Put the counting allocator in front of torch's CPU allocator (once per process; forked children inherit
    it). CPU memory allocated before this is not counted."""
    native().install(255)


def installed() -> bool:
    return _module is not None and _module.installed()


@dataclass(frozen=True)
class Stats:
    current: int  # bytes allocated now (of allocations made since install)
    peak: int  # the most bytes allocated at once since the last reset_peak
    peak_seq: int  # the event at which the peak was reached
    peak_phase: int  # the phase set (set_phase) when it was reached
    seq: int  # events (allocations and frees) counted so far
    n_alloc: int
    n_free: int
    unheard_free_bytes: int  # bytes the profiler heard allocated and did not hear freed (freed on another thread)
    unheard_free_count: int
    live: int  # allocations live now


def stats() -> Stats:
    return Stats(*native().stats())


def current() -> int:
    return stats().current


def reset_peak() -> tuple[int, int, int]:
    """Start the peak again from the bytes allocated now; returns the old ``(peak, peak_seq, peak_phase)``."""
    return tuple(native().reset_peak())


def restore_peak(old: tuple[int, int, int]) -> None:
    native().restore_peak(*old)


def set_phase(phase: int) -> int:
    return native().set_phase(phase)


def start_recording() -> None:
    native().start_recording()


def stop_recording() -> int:
    return native().stop_recording()


@dataclass(frozen=True)
class LiveAllocation:
    ptr: int
    size: int
    seq: int
    heard: bool  # the profiler (if one was recording) has an allocation event for it
    thread: int  # the counter's index of the allocating thread
    ordinal: int  # for heard ones: how many heard allocations of the same (ptr, size) the log has before it


def live_at(seq: int) -> list[LiveAllocation]:
    """The allocations live just after event ``seq`` (e.g. a peak's), from the log of the current or last recording
    (which must have started before that event)."""
    return [LiveAllocation(*t) for t in native().live_at(seq)]


def thread_index() -> int:
    """The counter's index of the calling thread."""
    return native().thread_index()


def install_thread() -> int:
    return native().install_thread()
