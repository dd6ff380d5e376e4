#pragma once
// SIGTERM / SIGINT caught for TrainingLoop's exit_signal_handler: the handler only
// records the signal; the loop reads it between iterations and stops every rank together.

namespace megatorch::train::exit_signals {

// Installs the handlers (SA_RESTART) for each loop that asks; the previous ones come back
// when the last such loop uninstalls.
void install();
void uninstall();
// The last signal caught (0: none).
int received();

}  // namespace megatorch::train::exit_signals
