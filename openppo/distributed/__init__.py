"""Ray process management: placement groups, worker groups of Ray actors, and their base worker class."""

from openppo.distributed.placement import (PlacementError, colocated_fraction, device_resources,
                                           make_placement_group)
from openppo.distributed.worker import BaseWorker
from openppo.distributed.worker_group import WorkerGroup, WorkerGroupError

__all__ = ["BaseWorker", "PlacementError", "WorkerGroup", "WorkerGroupError", "colocated_fraction",
           "device_resources", "make_placement_group"]
