// What every benchmark result carries: the machine, the git revision and a timestamp, so a JSON line
// can be read on its own months later.
#pragma once

#include <string>

#include "nlohmann/json.hpp"

namespace oryx::bench {

// {"cpu": model name, "cores": n, "gpu": name or null, "host_memory_gib": x}
nlohmann::json MachineInfo();
// `git rev-parse --short HEAD` of the working directory, or "unknown".
std::string GitRevision();
// Seconds since the epoch, ISO 8601 UTC.
std::string UtcTimestamp();
// {"machine", "git", "time"}: the provenance fields above, for a result line.
nlohmann::json Provenance();
// Median of the samples (copies and sorts).
double Median(std::vector<double> samples);

}  // namespace oryx::bench
