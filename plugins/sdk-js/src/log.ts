// Logging to the host's log, tagged with the plugin's name.
//
// Inside the sandbox the lines go through the `capstan:plugin/log` import (installed by
// `@capstan/sdk/component`); in Node (unit tests) they go to a sink the test chooses,
// by default stderr at info level and above.

import type { Level } from './contract.js';

export type { Level };

/** Where log lines go: the host's `log` interface, or a test's stand-in. */
export interface LogSink {
  enabled(level: Level): boolean;
  log(level: Level, message: string): void;
}

const ORDER: Record<Level, number> = { trace: 0, debug: 1, info: 2, warn: 3, error: 4 };

/**
 * The global `console`, typed here: a plugin project compiles the SDK without Node's
 * (or the DOM's) declarations, and both Node and the sandbox's engine have it.
 */
const stderr = (globalThis as unknown as { console: { error(line: string): void } }).console;

/** A sink for Node: lines at `minimum` and above go to stderr. */
export function stderrSink(minimum: Level = 'info'): LogSink {
  return {
    enabled: (level) => ORDER[level] >= ORDER[minimum],
    log: (level, message) => stderr.error(`[${level}] ${message}`),
  };
}

let sink: LogSink = stderrSink();

/** Replaces the sink; returns the previous one. */
export function setLogSink(next: LogSink): LogSink {
  const previous = sink;
  sink = next;
  return previous;
}

/** A message, or a function that builds it only when its level is enabled. */
export type Message = string | (() => string);

function write(level: Level, message: Message): void {
  if (sink.enabled(level)) {
    sink.log(level, typeof message === 'function' ? message() : message);
  }
}

/** Logging through the host. Pass a function to build an expensive message lazily. */
export const log = {
  /** Whether a line at `level` would be recorded; cheap. */
  enabled: (level: Level): boolean => sink.enabled(level),
  trace: (message: Message): void => write('trace', message),
  debug: (message: Message): void => write('debug', message),
  info: (message: Message): void => write('info', message),
  warn: (message: Message): void => write('warn', message),
  error: (message: Message): void => write('error', message),
};
