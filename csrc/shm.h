// Cross-process collectives between the processes (workers) of one host,
// through POSIX shared memory.  One segment per collective group; each group
// has its own worker thread, so groups never wait for each other and a
// group's runs are processed in order on every rank.
#ifndef EPL_CSRC_SHM_H_
#define EPL_CSRC_SHM_H_

#include <string>

#include "collectives.h"

namespace epl {

struct ShmArgs {
  std::string group;     // identical on every rank (includes the job id)
  int64 generation = 0;  // the k-th run of this group on this rank
  int rank = 0;
  int size = 1;
  int timeout_seconds = 600;
  std::string what;      // must agree across ranks
};

void ShmAllReduce(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done);
void ShmAllReduceN(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                   AsyncOpKernel::DoneCallback done);
void ShmAllGather(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done);
void ShmReduceScatter(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                      AsyncOpKernel::DoneCallback done);
void ShmBroadcast(const ShmArgs& a, int root, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done);
void ShmReduce(const ShmArgs& a, int root, ReduceOp op, OpKernelContext* ctx,
               AsyncOpKernel::DoneCallback done);
void ShmAllToAll(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done);

}  // namespace epl

#endif  // EPL_CSRC_SHM_H_
