// Stack traces that name the author's TypeScript, not the bundle componentize-js ran.
//
// The build (`capstan-js component`) bundles the plugin with esbuild, keeps the source map
// (sources relative to the project, no contents) and appends it to the bundle as
// `globalThis.__capstanSourceMap`. When a hook throws a bug, the SDK logs its stack with
// every position in the bundle (`reconcile@…/plugin.js:374:37`) replaced by the one in the
// source (`reconcile@src/plugin.ts:42:11`). In Node (unit tests) there is no map and
// stacks stay as they are.

/** What the build appends: the standard source map fields the lookup needs. */
export interface SourceMap {
  sources: string[];
  mappings: string;
}

/** A decoded segment: generated column, source index, source line, source column (0-based). */
type Segment = [number, number, number, number];

const BASE64 = 'ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/';

/** The numbers of one segment (base64 VLQ: 5 bits a digit, continuation bit 32, sign bit 1). */
function decodeVlq(text: string): number[] | undefined {
  const values: number[] = [];
  let value = 0;
  let shift = 0;
  for (const ch of text) {
    const digit = BASE64.indexOf(ch);
    if (digit < 0) {
      return undefined;
    }
    value += (digit & 31) * 2 ** shift;
    if (digit & 32) {
      shift += 5;
    } else {
      values.push(value % 2 === 1 ? -Math.floor(value / 2) : value / 2);
      value = 0;
      shift = 0;
    }
  }
  return values;
}

/** The segments of every generated line; undefined when the map is malformed. */
export function decodeMappings(mappings: string): Segment[][] | undefined {
  const lines: Segment[][] = [];
  let source = 0;
  let sourceLine = 0;
  let sourceColumn = 0;
  for (const line of mappings.split(';')) {
    const segments: Segment[] = [];
    let column = 0;
    for (const text of line.split(',')) {
      if (text === '') {
        continue;
      }
      const v = decodeVlq(text);
      if (v === undefined || v.length === 0) {
        return undefined;
      }
      column += v[0]!;
      if (v.length >= 4) {
        source += v[1]!;
        sourceLine += v[2]!;
        sourceColumn += v[3]!;
        segments.push([column, source, sourceLine, sourceColumn]);
      }
    }
    lines.push(segments);
  }
  return lines;
}

/** A map and its decoded lines, ready for lookups. */
export class SourcePositions {
  readonly #sources: string[];
  readonly #lines: Segment[][];

  private constructor(sources: string[], lines: Segment[][]) {
    this.#sources = sources;
    this.#lines = lines;
  }

  static of(map: SourceMap | undefined): SourcePositions | undefined {
    if (!map || !Array.isArray(map.sources) || typeof map.mappings !== 'string') {
      return undefined;
    }
    const lines = decodeMappings(map.mappings);
    return lines && new SourcePositions(map.sources, lines);
  }

  /** `source:line:column` (1-based) of a 1-based position in the bundle, if mapped. */
  lookup(line: number, column: number): string | undefined {
    const segments = this.#lines[line - 1];
    let found: Segment | undefined;
    for (const s of segments ?? []) {
      if (s[0] > column - 1) {
        break;
      }
      found = s;
    }
    if (!found) {
      return undefined;
    }
    const source = this.#sources[found[1]];
    return source === undefined ? undefined : `${source}:${found[2] + 1}:${found[3] + 1}`;
  }

  /** `stack` with each position in the bundle (`…plugin.js:L:C`) replaced by its source's. */
  mapStack(stack: string): string {
    return stack.replace(/[^\s@()]*plugin\.js:(\d+):(\d+)/g, (whole, line: string, column: string) =>
      this.lookup(Number(line), Number(column)) ?? whole,
    );
  }
}

let positions: SourcePositions | null | undefined;

/** `stack` mapped through the map the build appended to the bundle, if there is one. */
export function mapStack(stack: string): string {
  if (positions === undefined) {
    const map = (globalThis as { __capstanSourceMap?: SourceMap }).__capstanSourceMap;
    positions = SourcePositions.of(map) ?? null;
  }
  return positions ? positions.mapStack(stack) : stack;
}
