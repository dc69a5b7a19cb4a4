// Cross-host collectives over TCP: a ring between the processes (workers) of a job.
//
// Every process listens on its address in EPL_COMM_ADDRESSES ("host:port" per rank,
// rank = worker index; set by epl-launch).  Each collective group opens its own ring
// connections (rank r sends to r+1 and receives from r-1), announced by a header
// naming the group, and runs on its own thread, in generation order.
#ifndef EPL_CSRC_TCP_H_
#define EPL_CSRC_TCP_H_

#include "collectives.h"
#include "shm.h"

namespace epl {

void TcpAllReduce(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done);
void TcpAllReduceN(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                   AsyncOpKernel::DoneCallback done);
void TcpAllGather(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done);
void TcpReduceScatter(const ShmArgs& a, ReduceOp op, OpKernelContext* ctx,
                      AsyncOpKernel::DoneCallback done);
void TcpReduce(const ShmArgs& a, int root, ReduceOp op, OpKernelContext* ctx,
               AsyncOpKernel::DoneCallback done);
void TcpAllToAll(const ShmArgs& a, OpKernelContext* ctx, AsyncOpKernel::DoneCallback done);
void TcpBroadcast(const ShmArgs& a, int root, OpKernelContext* ctx,
                  AsyncOpKernel::DoneCallback done);

}  // namespace epl

#endif  // EPL_CSRC_TCP_H_
