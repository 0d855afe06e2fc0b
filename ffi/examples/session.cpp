// The C++ example of docs/c-api.md (scripts/doc-commands.py checks that the
// two stay the same, and runs the commands that build and run it).
#include <kungfu.hpp>
#include <vector>

int main() {
    kungfu::session kf;  // kf_init; kf_finalize when it goes out of scope
    std::vector<float> grad(1 << 20, float(kf.rank())), avg(grad.size());
    kungfu::handle h = kf.allreduce<float>(grad, avg, KF_AVG, "grad/fc1");
    h.wait();            // throws kungfu::error (with .status()) on failure
    {
        kungfu::group g; // fuse what follows
        // ... kf.allreduce(...) of small tensors ...
        g.end();
    }
}
