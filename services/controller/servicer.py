"""ControllerService over gRPC: a thin adapter from requests to the Controller."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from replicaplane.controller.v1 import controller_service_pb2 as api
from replicaplane.controller.v1 import controller_service_pb2_grpc as api_grpc
from services.common import overrides
from services.controller import controller, rollout_api, traces


class ControllerServicer(api_grpc.ControllerServiceServicer):
    """Maps each RPC to one Controller call; errors are mapped by the interceptor."""

    def __init__(self, ctl: controller.Controller) -> None:
        self._ctl = ctl

    async def CreateService(
        self, request: api.CreateServiceRequest, context: grpc.aio.ServicerContext
    ) -> api.CreateServiceResponse:
        text = overrides.apply(request.yaml, envs=request.env_overrides, secrets=request.secret_overrides)
        with self._ctl.traces.origin(lambda: request.service_name or traces.service_name_of(text), lambda: 1):
            svc = await self._ctl.create_service(request.service_name, text, request_id=request.request_id)
        return api.CreateServiceResponse(service=svc)

    async def GetService(
        self, request: api.GetServiceRequest, context: grpc.aio.ServicerContext
    ) -> api.GetServiceResponse:
        return api.GetServiceResponse(service=self._ctl.get_service(request.service_name))

    async def ListServices(
        self, request: api.ListServicesRequest, context: grpc.aio.ServicerContext
    ) -> api.ListServicesResponse:
        services, token = self._ctl.list_services(request.page_size, request.page_token)
        return api.ListServicesResponse(services=services, next_page_token=token)

    async def UpdateService(
        self, request: api.UpdateServiceRequest, context: grpc.aio.ServicerContext
    ) -> api.UpdateServiceResponse:
        text = overrides.apply(request.yaml, envs=request.env_overrides, secrets=request.secret_overrides)
        mode = rollout_api.update_mode(request.mode, text)  # the spec's strategy when the request names none
        with self._ctl.traces.origin(
            lambda: "" if request.dry_run else request.service_name,
            lambda: self._ctl.get_service(request.service_name).latest_version + 1,
        ):
            svc, plan = await self._ctl.update_service(request.service_name, text, mode=mode, dry_run=request.dry_run)
        return api.UpdateServiceResponse(service=svc, plan=plan)

    async def DeleteService(
        self, request: api.DeleteServiceRequest, context: grpc.aio.ServicerContext
    ) -> api.DeleteServiceResponse:
        return api.DeleteServiceResponse(
            service=await self._ctl.delete_service(request.service_name, purge=request.purge)
        )

    async def ListReplicas(
        self, request: api.ListReplicasRequest, context: grpc.aio.ServicerContext
    ) -> api.ListReplicasResponse:
        replicas, token = self._ctl.list_replicas(request.service_name, request.page_size, request.page_token)
        return api.ListReplicasResponse(replicas=replicas, next_page_token=token)

    async def GetReplica(
        self, request: api.GetReplicaRequest, context: grpc.aio.ServicerContext
    ) -> api.GetReplicaResponse:
        return api.GetReplicaResponse(replica=self._ctl.get_replica(request.service_name, request.replica_id))

    async def TerminateReplica(
        self, request: api.TerminateReplicaRequest, context: grpc.aio.ServicerContext
    ) -> api.TerminateReplicaResponse:
        replica = await self._ctl.terminate_replica(request.service_name, request.replica_id, purge=request.purge)
        return api.TerminateReplicaResponse(replica=replica)

    async def PurgeReplicas(
        self, request: api.PurgeReplicasRequest, context: grpc.aio.ServicerContext
    ) -> api.PurgeReplicasResponse:
        return api.PurgeReplicasResponse(replica_ids=await self._ctl.purge_replicas(request.service_name))

    async def WatchService(
        self, request: api.WatchServiceRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.WatchServiceResponse]:
        async for msg in self._ctl.watch_service(request.service_name, request.after_sequence):
            yield msg

    async def ReportLoad(
        self, request: api.ReportLoadRequest, context: grpc.aio.ServicerContext
    ) -> api.ReportLoadResponse:
        return self._ctl.report_load(request)

    async def WatchEndpoints(
        self, request: api.WatchEndpointsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.WatchEndpointsResponse]:
        async for msg in self._ctl.watch_endpoints(request.service_name, request.after_version):
            yield msg

    async def StreamReplicaLogs(
        self, request: api.StreamReplicaLogsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.StreamReplicaLogsResponse]:
        logs = self._ctl.stream_replica_logs(
            request.service_name, request.replica_id, request.kind, follow=request.follow
        )
        async for chunk in logs:
            yield api.StreamReplicaLogsResponse(data=chunk)

    async def ListOrphans(
        self, request: api.ListOrphansRequest, context: grpc.aio.ServicerContext
    ) -> api.ListOrphansResponse:
        orphans = self._ctl.orphans
        page, token = await orphans.list(
            owner=request.owner, page_size=request.page_size, page_token=request.page_token
        )
        return api.ListOrphansResponse(orphans=page, next_page_token=token, controller_id=orphans.controller_id)

    async def ReapOrphans(
        self, request: api.ReapOrphansRequest, context: grpc.aio.ServicerContext
    ) -> api.ReapOrphansResponse:
        orphans = self._ctl.orphans
        reaped, skipped = await orphans.reap(
            owner=request.owner, all_owners=request.all_owners, names=list(request.replica_names)
        )
        return api.ReapOrphansResponse(
            reaped=reaped,
            skipped=[api.SkippedOrphan(replica_name=s.replica_name, reason=s.reason) for s in skipped],
            controller_id=orphans.controller_id,
        )

    async def SubmitJob(
        self, request: api.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> api.SubmitJobResponse:
        return api.SubmitJobResponse(job=self._ctl.jobs.submit(request))

    async def GetJob(self, request: api.GetJobRequest, context: grpc.aio.ServicerContext) -> api.GetJobResponse:
        return api.GetJobResponse(job=self._ctl.jobs.get(request))

    async def ListJobs(self, request: api.ListJobsRequest, context: grpc.aio.ServicerContext) -> api.ListJobsResponse:
        jobs, token = self._ctl.jobs.list(request)
        return api.ListJobsResponse(jobs=jobs, next_page_token=token)

    async def CancelJob(
        self, request: api.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> api.CancelJobResponse:
        return api.CancelJobResponse(job=await self._ctl.jobs.cancel(request))

    async def WatchJob(
        self, request: api.WatchJobRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.WatchJobResponse]:
        async for msg in self._ctl.jobs.watch(request):
            yield msg

    async def ListEvents(
        self, request: api.ListEventsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListEventsResponse:
        found, token = self._ctl.versions.event_log.list(request.service_name, request.page_size, request.page_token)
        return api.ListEventsResponse(events=found, next_page_token=token)

    async def WatchEvents(
        self, request: api.WatchEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[api.WatchEventsResponse]:
        async for event in self._ctl.versions.event_log.watch(request.service_name, request.after_sequence):
            yield api.WatchEventsResponse(event=event)

    async def ListVersions(
        self, request: api.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListVersionsResponse:
        return api.ListVersionsResponse(versions=self._ctl.versions.list(request.service_name))

    async def RollbackService(
        self, request: api.RollbackServiceRequest, context: grpc.aio.ServicerContext
    ) -> api.RollbackServiceResponse:
        svc, plan, to = await self._ctl.versions.rollback(
            request.service_name, request.to_version, dry_run=request.dry_run
        )
        return api.RollbackServiceResponse(service=svc, plan=plan, to_version=to)

    async def PromoteRollout(
        self, request: api.PromoteRolloutRequest, context: grpc.aio.ServicerContext
    ) -> api.PromoteRolloutResponse:
        return api.PromoteRolloutResponse(service=self._ctl.versions.promote(request.service_name, full=request.full))

    async def AbortRollout(
        self, request: api.AbortRolloutRequest, context: grpc.aio.ServicerContext
    ) -> api.AbortRolloutResponse:
        return api.AbortRolloutResponse(service=self._ctl.versions.abort(request.service_name))
