// grpcgo: a CRI client built on grpc-go, the HTTP/2 stack the kubelet uses, for the test suite
// (tests/test_grpc_go_client.py). It needs no generated protobuf code: requests and responses
// are raw message bytes (a codec that passes []byte through), method paths are given as text.
//
// Build (offline, Debian's Go library sources: apt-get install golang-go golang-google-grpc-dev):
//
//	GO111MODULE=off GOPATH=/usr/share/gocode go build -o grpcgo tests/grpcgo/main.go
//
// Usage:
//
//	grpcgo -target /path/to/cri.sock [-calls FILE|-] [-workers N] [-max-recv BYTES] [-max-send BYTES]
//
// Calls are JSON lines, read from FILE or stdin ("-", the default) and answered as they come, so
// a test can drive it interactively (write one call, read its answer) or in a batch:
//
//	{"id": 1, "method": "/runtime.v1.RuntimeService/Version", "request": "<base64>",
//	 "timeout": 10, "stream": false, "metadata": {"key": "value"}}
//
// Each call is answered with one JSON line on stdout (in completion order when -workers > 1):
//
//	{"id": 1, "method": "...", "code": 0, "message": "", "responses": ["<base64>", ...],
//	 "details": "<base64 google.rpc.Status, only when it carries details>",
//	 "header": {...}, "trailer": {...}, "ms": 1.2}
//
// Like the kubelet (k8s.io/kubernetes/pkg/kubelet/cri/remote, v1.23): one grpc.ClientConn per
// service (RuntimeService and ImageService), dialled with WithInsecure, a unix-socket context
// dialer and WithBlock; message size limits 16 MiB both ways unless raised; every other HTTP/2
// setting is grpc-go's default (dynamic flow-control windows with BDP pings, HPACK with a
// dynamic table, header blocks split into CONTINUATION frames when larger than a frame). N
// workers share the connections, like the kubelet's pod workers and PLEG relists.
package main

import (
	"bufio"
	"context"
	"encoding/base64"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/golang/protobuf/proto"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// rawCodec passes message bytes through unchanged. Named "proto" so that the content-type is
// "application/grpc", exactly what the kubelet's proto codec sends (ForceCodec sets no subtype).
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) {
	switch m := v.(type) {
	case *[]byte:
		return *m, nil
	case []byte:
		return m, nil
	}
	return nil, fmt.Errorf("rawCodec: cannot marshal %T", v)
}

func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	p, ok := v.(*[]byte)
	if !ok {
		return fmt.Errorf("rawCodec: cannot unmarshal into %T", v)
	}
	*p = append([]byte{}, data...)
	return nil
}

func (rawCodec) Name() string { return "proto" }

type call struct {
	ID       int64             `json:"id"`
	Method   string            `json:"method"`
	Request  string            `json:"request"`
	Timeout  float64           `json:"timeout"`
	Stream   bool              `json:"stream"`
	Metadata map[string]string `json:"metadata"`
}

type result struct {
	ID        int64               `json:"id"`
	Method    string              `json:"method"`
	Code      int                 `json:"code"`
	Message   string              `json:"message"`
	Responses []string            `json:"responses"`
	Details   string              `json:"details"`
	Header    map[string][]string `json:"header"`
	Trailer   map[string][]string `json:"trailer"`
	Ms        float64             `json:"ms"`
}

func dial(target string, maxRecv, maxSend int) (*grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	dialer := func(ctx context.Context, addr string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", addr)
	}
	return grpc.DialContext(ctx, target,
		grpc.WithInsecure(),
		grpc.WithBlock(),
		grpc.WithContextDialer(dialer),
		grpc.WithDefaultCallOptions(
			grpc.MaxCallRecvMsgSize(maxRecv),
			grpc.MaxCallSendMsgSize(maxSend),
			grpc.ForceCodec(rawCodec{}),
		))
}

func mdMap(md metadata.MD) map[string][]string {
	out := map[string][]string{}
	for k, v := range md {
		if strings.HasSuffix(k, "-bin") {
			enc := make([]string, len(v))
			for i, x := range v {
				enc[i] = base64.StdEncoding.EncodeToString([]byte(x))
			}
			v = enc
		}
		out[k] = v
	}
	return out
}

func run(conn *grpc.ClientConn, c call) result {
	r := result{ID: c.ID, Method: c.Method, Responses: []string{}}
	req, err := base64.StdEncoding.DecodeString(c.Request)
	if err != nil {
		r.Code, r.Message = -1, "request is not base64: "+err.Error()
		return r
	}
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = 10
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(timeout*float64(time.Second)))
	defer cancel()
	if len(c.Metadata) > 0 {
		ctx = metadata.NewOutgoingContext(ctx, metadata.New(c.Metadata))
	}
	var header, trailer metadata.MD
	start := time.Now()
	if c.Stream {
		desc := &grpc.StreamDesc{StreamName: c.Method, ServerStreams: true}
		var s grpc.ClientStream
		s, err = conn.NewStream(ctx, desc, c.Method)
		if err == nil {
			err = s.SendMsg(&req)
			if err == nil {
				err = s.CloseSend()
			}
			for err == nil {
				var msg []byte
				if err = s.RecvMsg(&msg); err == nil {
					r.Responses = append(r.Responses, base64.StdEncoding.EncodeToString(msg))
				}
			}
			if err == io.EOF {
				err = nil
			}
			header, _ = s.Header()
			trailer = s.Trailer()
		}
	} else {
		var resp []byte
		err = conn.Invoke(ctx, c.Method, &req, &resp, grpc.Header(&header), grpc.Trailer(&trailer))
		if err == nil {
			r.Responses = append(r.Responses, base64.StdEncoding.EncodeToString(resp))
		}
	}
	r.Ms = float64(time.Since(start).Microseconds()) / 1000
	st := status.Convert(err)
	r.Code, r.Message = int(st.Code()), st.Message()
	if p := st.Proto(); p != nil && len(p.Details) > 0 {
		if b, merr := proto.Marshal(p); merr == nil {
			r.Details = base64.StdEncoding.EncodeToString(b)
		}
	}
	r.Header, r.Trailer = mdMap(header), mdMap(trailer)
	return r
}

func main() {
	target := flag.String("target", "", "the CRI socket's path (or unix:///path)")
	callsFile := flag.String("calls", "-", "JSON lines of calls; - for stdin")
	workers := flag.Int("workers", 1, "parallel callers sharing the connections")
	maxRecv := flag.Int("max-recv", 16*1024*1024, "MaxCallRecvMsgSize (the kubelet's is 16 MiB)")
	maxSend := flag.Int("max-send", 16*1024*1024, "MaxCallSendMsgSize (the kubelet's is 16 MiB)")
	flag.Parse()
	path := strings.TrimPrefix(strings.TrimPrefix(*target, "unix://"), "unix:")
	if path == "" || *workers < 1 {
		fmt.Fprintln(os.Stderr, "usage: grpcgo -target SOCKET [-calls FILE|-] [-workers N] [-max-recv B] [-max-send B]")
		os.Exit(2)
	}
	runtimeConn, err := dial(path, *maxRecv, *maxSend)
	if err != nil {
		fmt.Fprintf(os.Stderr, "grpcgo: cannot connect to %s: %v\n", path, err)
		os.Exit(2)
	}
	imageConn, err := dial(path, *maxRecv, *maxSend)
	if err != nil {
		fmt.Fprintf(os.Stderr, "grpcgo: cannot connect to %s: %v\n", path, err)
		os.Exit(2)
	}
	in := os.Stdin
	if *callsFile != "-" {
		if in, err = os.Open(*callsFile); err != nil {
			fmt.Fprintln(os.Stderr, "grpcgo:", err)
			os.Exit(2)
		}
	}
	out := bufio.NewWriter(os.Stdout)
	var outMu sync.Mutex
	emit := func(r result) {
		line, _ := json.Marshal(r)
		outMu.Lock()
		out.Write(line)
		out.WriteByte('\n')
		out.Flush()
		outMu.Unlock()
	}
	calls := make(chan call)
	var wg sync.WaitGroup
	for i := 0; i < *workers; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for c := range calls {
				conn := runtimeConn
				if strings.HasPrefix(c.Method, "/runtime.v1.ImageService/") {
					conn = imageConn
				}
				emit(run(conn, c))
			}
		}()
	}
	reader := bufio.NewReaderSize(in, 1<<20)
	for {
		line, rerr := reader.ReadBytes('\n')
		if len(strings.TrimSpace(string(line))) > 0 {
			var c call
			if err := json.Unmarshal(line, &c); err != nil {
				emit(result{ID: -1, Code: -1, Message: "bad input line: " + err.Error(), Responses: []string{}})
			} else {
				calls <- c
			}
		}
		if rerr != nil {
			break
		}
	}
	close(calls)
	wg.Wait()
	runtimeConn.Close()
	imageConn.Close()
}
