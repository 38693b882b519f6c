// The simulated device at the allocator: c10's CPU allocator wrapped so that every allocation
// (eager ops, compiled code, kernels' scratch) is counted against the meter armed at that moment,
// with its budget enforced before the memory is handed out. Built at first use by
// mimose_cli/memory/allocator.py; read that module's docstring first.
//
// Each allocation carries a 64-byte header in front of its data (the data stays 64-byte aligned,
// as c10 aligns it) naming its size and the counter it is charged to, so that the DataPtr's
// context is its data pointer: c10's raw_allocate (oneDNN's scratch goes through it) requires
// that, and the free needs no lookup table.
#include <torch/csrc/utils/pybind.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <pthread.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <new>
#include <string>
#include <thread>

namespace {

constexpr size_t kHeader = 64;
constexpr uint64_t kMagic = 0x6d696d6f73656d31ull;

// One meter's figures. Never deleted: a storage charged to a meter may outlive it, and its free
// still decrements this counter (a few dozen bytes per meter ever built).
struct Counter {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> refused{0};  // live bytes the largest refused allocation would have made
  std::atomic<int64_t> budget{-1};  // -1: unlimited
  py::object handler;               // pressure handler, called with the GIL held; None if unset
};

struct Header {
  uint64_t magic;
  void* data;  // the data it heads: with the magic, tells our allocations from others' (release_raw)
  int64_t nbytes;
  Counter* counter;  // nullptr: allocated while no meter was armed (or host memory)
};
static_assert(sizeof(Header) <= kHeader, "the header must fit in front of the data");

c10::Allocator* base = nullptr;
std::atomic<Counter*> armed{nullptr};
std::thread::id armed_thread;
thread_local bool host_side = false;   // this thread makes offloaded copies: host memory
thread_local bool relieving = false;   // this thread runs the pressure handler

Header* header_of(void* data) {
  return reinterpret_cast<Header*>(static_cast<char*>(data) - kHeader);
}

void raise_peak(Counter* c, int64_t now) {
  int64_t peak = c->peak.load(std::memory_order_relaxed);
  while (now > peak && !c->peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// format_bytes of mimose_cli/units.py, so that the message reads as the dispatch meter's.
std::string format_bytes(int64_t num_bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  double value = static_cast<double>(num_bytes);
  char text[64];
  for (int i = 0; i < 4; ++i) {
    if (std::fabs(value) < 1024 || i == 3) {
      std::snprintf(text, sizeof(text), i == 0 ? "%.0f %s" : "%.2f %s", value, units[i]);
      return text;
    }
    value /= 1024;
  }
  return text;
}

// Ask the pressure handler to free `need` bytes; true if it ran. Only on the thread that armed
// the meter (the training loop's), never re-entered: an intra-op worker waiting for the GIL
// while the main thread waits for that worker would deadlock.
bool relieve(Counter* c, int64_t need) {
  if (relieving || std::this_thread::get_id() != armed_thread) {
    return false;
  }
  py::gil_scoped_acquire gil;
  if (c->handler.is_none()) {
    return false;
  }
  relieving = true;
  try {
    c->handler(need);
  } catch (...) {
    relieving = false;
    throw;
  }
  relieving = false;
  return true;
}

// Charge `n` bytes to `c`, or raise OutOfMemoryError if they break its budget.
void charge(Counter* c, int64_t n, bool may_relieve) {
  int64_t now = c->live.fetch_add(n, std::memory_order_relaxed) + n;
  int64_t budget = c->budget.load(std::memory_order_relaxed);
  if (budget >= 0 && now > budget && !relieving) {
    c->live.fetch_sub(n, std::memory_order_relaxed);
    if (may_relieve && relieve(c, now - budget)) {
      return charge(c, n, false);
    }
    int64_t refused = c->refused.load(std::memory_order_relaxed);
    while (now > refused && !c->refused.compare_exchange_weak(refused, now)) {
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "simulated device out of memory: tried to allocate ",
                     format_bytes(n), " (live ", format_bytes(now - n), ") with a budget of ",
                     format_bytes(budget));
  }
  raise_peak(c, now);
}

void release(void* data) {
  Header* h = header_of(data);
  if (h->counter != nullptr) {
    h->counter->live.fetch_sub(h->nbytes, std::memory_order_relaxed);
  }
  h->magic = 0;
  base->raw_deallocate(h);
}

// What raw_deallocate calls. Code that frees by asking the *current* allocator (oneDNN's scratch,
// through c10's raw_deallocate) can hand us memory the allocator we replaced made before we were
// installed: that memory has no header of ours, so it goes back to that allocator. Reading the
// 64 bytes in front of such a pointer is safe with c10's 64-byte aligned allocations (they lie
// inside the same heap or mapping); the data pointer stored beside the magic rules out a match
// by chance, and the magic is cleared when our memory is freed.
void release_raw(void* data) {
  if (data == nullptr) {
    return;
  }
  Header* h = header_of(data);
  if (h->magic == kMagic && h->data == data) {
    release(data);
  } else {
    base->raw_deallocate(data);
  }
}

struct CountingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    if (n == 0) {
      return base->allocate(0);  // no memory, nothing to count
    }
    Counter* c = host_side ? nullptr : armed.load(std::memory_order_acquire);
    if (c != nullptr) {
      charge(c, static_cast<int64_t>(n), true);
    }
    void* raw = nullptr;
    try {
      raw = base->raw_allocate(n + kHeader);
    } catch (...) {
      if (c != nullptr) {
        c->live.fetch_sub(static_cast<int64_t>(n), std::memory_order_relaxed);
      }
      // The base allocator's error names the size it was asked for, n + our header: ask it for n
      // alone, so that the error the user sees names their own size, as without this allocator.
      void* plain = base->raw_allocate(n);
      base->raw_deallocate(plain);  // n alone fitted (n + 64 did not): the first error stands
      throw;
    }
    void* data = static_cast<char*>(raw) + kHeader;
    new (raw) Header{kMagic, data, static_cast<int64_t>(n), c};
    return {data, data, &release, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &release_raw; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

CountingAllocator counting;

void disarm_in_child() { armed.store(nullptr); }

// Put the counting allocator in front of c10's; once per process (later calls do nothing).
void install() {
  if (base != nullptr) {
    return;
  }
  c10::Allocator* current = c10::GetCPUAllocator();
  TORCH_CHECK(current->raw_deleter() != nullptr,
              "the CPU allocator was replaced by another library; mimose's allocator meter "
              "cannot wrap it (use memory.meter: dispatch)");
  base = current;
  c10::SetCPUAllocator(&counting, /*priority=*/255);
  TORCH_CHECK(c10::GetCPUAllocator() == &counting,
              "another CPU allocator has a higher priority; mimose's allocator meter cannot be "
              "installed (use memory.meter: dispatch)");
  // A forked child (a DataLoader worker) has its own memory: never charge it to our meter.
  pthread_atfork(nullptr, nullptr, &disarm_in_child);
}

bool installed() { return base != nullptr; }

void arm(Counter* c) {
  TORCH_CHECK(armed.load() == nullptr, "an allocator meter is already active in this process");
  armed_thread = std::this_thread::get_id();
  armed.store(c, std::memory_order_release);
}

void disarm(Counter* c) {
  Counter* expected = c;
  armed.compare_exchange_strong(expected, nullptr);
}

// Charge a storage made while no meter was armed (or charged to another meter) to `c`: bytes
// added, 0 if already charged to it, -1 if another allocator made it (the caller counts it).
int64_t adopt(Counter* c, const at::Storage& storage) {
  const c10::DataPtr& data_ptr = storage.data_ptr();
  if (data_ptr.get_deleter() != &release) {
    return -1;
  }
  Header* h = header_of(data_ptr.get());
  TORCH_INTERNAL_ASSERT(h->magic == kMagic && h->data == data_ptr.get());
  if (h->counter == c) {
    return 0;
  }
  if (h->counter != nullptr) {
    h->counter->live.fetch_sub(h->nbytes, std::memory_order_relaxed);
  }
  h->counter = c;
  raise_peak(c, c->live.fetch_add(h->nbytes, std::memory_order_relaxed) + h->nbytes);
  return h->nbytes;
}

void add_external(Counter* c, int64_t n) {
  raise_peak(c, c->live.fetch_add(n, std::memory_order_relaxed) + n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Counter, std::unique_ptr<Counter, py::nodelete>>(m, "Counter")
      .def(py::init([]() {
        auto* c = new Counter();
        c->handler = py::none();
        return c;
      }))
      .def_property_readonly("live", [](Counter& c) { return c.live.load(); })
      .def_property_readonly("peak", [](Counter& c) { return c.peak.load(); })
      .def_property_readonly("refused", [](Counter& c) { return c.refused.load(); })
      .def_property("budget", [](Counter& c) { return c.budget.load(); },
                    [](Counter& c, int64_t b) { c.budget.store(b); })
      .def("reset_peak", [](Counter& c) {
        c.peak.store(c.live.load());
        c.refused.store(0);
      })
      .def("set_handler", [](Counter& c, py::object handler) { c.handler = std::move(handler); })
      .def("adopt", &adopt)
      .def("add_external", &add_external);
  m.def("install", &install);
  m.def("installed", &installed);
  m.def("arm", &arm);
  m.def("disarm", &disarm);
  m.def("set_host_side", [](bool on) { host_side = on; });
}
