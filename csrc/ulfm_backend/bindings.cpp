// Python bindings of the ulfm backend (module megatron_recover.collective._ulfm_backend).
// torch.distributed must be imported first: the classes below derive from its Work and Backend.
#include <torch/extension.h>
#include <torch/csrc/utils/pybind.h>

#include "ulfm_backend.hpp"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ULFM fault-tolerant torch.distributed backend (see ulfm_backend.hpp)";

  py::class_<ulfm::FailureRecord>(m, "FailureRecord")
      .def_readonly("failed_ranks", &ulfm::FailureRecord::failed_ranks)
      .def_readonly("size", &ulfm::FailureRecord::size)
      .def_readonly("rank", &ulfm::FailureRecord::rank)
      .def_readonly("epoch", &ulfm::FailureRecord::epoch)
      .def_readonly("repaired", &ulfm::FailureRecord::repaired)
      .def_readonly("census", &ulfm::FailureRecord::census)
      .def_readonly("started_s", &ulfm::FailureRecord::started_s)
      .def_readonly("finished_s", &ulfm::FailureRecord::finished_s);

  py::class_<ulfm::WorkULFM, c10d::Work, c10::intrusive_ptr<ulfm::WorkULFM>>(m, "WorkULFM")
      .def("has_failure", &ulfm::WorkULFM::has_failure)
      .def("record", &ulfm::WorkULFM::record);

  using PG = ulfm::ProcessGroupULFM;
  auto nogil = py::call_guard<py::gil_scoped_release>();
  py::class_<PG, c10d::Backend, c10::intrusive_ptr<PG>>(m, "ProcessGroupULFM")
      .def(py::init([](std::vector<int64_t> world_ranks, std::string name, double timeout_s) {
             ulfm::GroupOptions options;
             options.world_ranks = std::move(world_ranks);
             options.name = std::move(name);
             options.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
             return c10::make_intrusive<PG>(std::move(options));
           }),
           py::arg("world_ranks"), py::arg("name"), py::arg("timeout_s"), nogil)
      .def(py::init([](std::vector<int64_t> world_ranks, std::string name, double timeout_s,
                       c10::intrusive_ptr<PG> parent) {
             ulfm::GroupOptions options;
             options.world_ranks = std::move(world_ranks);
             options.name = std::move(name);
             options.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
             options.parent = parent.get();
             return c10::make_intrusive<PG>(std::move(options));
           }),
           py::arg("world_ranks"), py::arg("name"), py::arg("timeout_s"), py::arg("parent"),
           nogil)
      .def(py::init([](std::vector<int64_t> world_ranks, std::string name, double timeout_s,
                       int64_t duplicate) {
             ulfm::GroupOptions options;
             options.world_ranks = std::move(world_ranks);
             options.name = std::move(name);
             options.timeout = std::chrono::milliseconds(int64_t(timeout_s * 1000.0));
             options.duplicate = duplicate;
             return c10::make_intrusive<PG>(std::move(options));
           }),
           py::arg("world_ranks"), py::arg("name"), py::arg("timeout_s"), py::arg("duplicate"),
           nogil)
      .def("set_agree_each_op", &PG::set_agree_each_op, py::arg("on"))
      .def("set_max_chunk_bytes", &PG::set_max_chunk_bytes, py::arg("bytes"))
      .def("set_stage_host", &PG::set_stage_host, py::arg("on"))
      .def("set_direct_device", &PG::set_direct_device, py::arg("on"))
      .def("staging_stats", &PG::staging_stats)
      .def("allreduce_sum", &PG::allreduce_sum, py::arg("tensor"), nogil)
      .def("broadcast_from", &PG::broadcast_from, py::arg("tensor"), py::arg("root_world_rank"),
           nogil)
      .def("allgather_into", &PG::allgather_into, py::arg("output"), py::arg("input"), nogil)
      .def("barrier_ft", &PG::barrier_ft, nogil)
      .def("consensus", &PG::consensus, py::arg("census"), nogil)
      .def("adopt", &PG::adopt, py::arg("grown_handle"), nogil)
      .def("epoch", &PG::epoch)
      .def("current_size", &PG::current_size)
      .def("current_rank", &PG::current_rank)
      .def("members", &PG::members)
      .def("arm_fault",
           [](PG& pg, std::string point, int64_t occurrence, std::string action, double delay_s,
              std::string marker_path, std::string marker_fields) {
             pg.arm_fault({std::move(point), occurrence, std::move(action), delay_s,
                           std::move(marker_path), std::move(marker_fields)});
           },
           py::arg("point"), py::arg("occurrence"), py::arg("action"), py::arg("delay_s"),
           py::arg("marker_path"), py::arg("marker_fields") = "")
      .def("fault_hits", &PG::fault_hits, py::arg("point"));

  m.def("fault_tolerance_enabled", &ulfm::fault_tolerance_enabled);
  m.def("set_fault_phase", &ulfm::set_fault_phase, py::arg("phase"));
  m.def("mpi_cuda_aware", &ulfm::mpi_cuda_aware);
}
